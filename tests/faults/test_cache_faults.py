"""The baseline cache under faults: its filesystem full while a baseline unpacks, pytest
SIGKILLed mid-unpack and mid-warm-up, the unpacked tree's metadata damaged.

Each run ends in a clear error (or works), the next run works, nothing is left on the host
(``smol_state`` checks guests, mounts, cgroups and records) and no staging dir stays in the cache.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm.baselines.archive import apply_layer, decompressed
from pytest_smolvm.errors import UsageError
from tests.faults.conftest import wait_for

NS = ["-p", "no:cacheprovider", "--smol-backend=namespace"]
GUEST_TEST = """
    def test_guest(smol_vm):
        assert smol_vm.exec("cat /etc/alpine-release").exit_code == 0
"""


def staging_dirs(cache: Path) -> list[str]:
    store = cache / "baselines"
    return sorted(p.name for p in store.glob(".*")) if store.is_dir() else []


def test_cache_filesystem_full_while_a_baseline_unpacks(pytester: pytest.Pytester, smol_state: Path,
                                                        small_fs: object, monkeypatch: pytest.MonkeyPatch) -> None:
    home = small_fs("3m")  # type: ignore[operator]
    monkeypatch.delenv("PYTEST_SMOLVM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    pytester.makepyfile(GUEST_TEST)
    result = pytester.runpytest_subprocess(*NS)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*No space left on device*"])
    assert "Traceback" not in result.stdout.str()
    assert staging_dirs(home / "pytest-smolvm") == []
    # room again (the same cache): the next run unpacks and passes
    subprocess.run(["mount", "-o", "remount,size=256m", str(home)], check=True)
    pytester.runpytest_subprocess(*NS).assert_outcomes(passed=1)
    assert staging_dirs(home / "pytest-smolvm") == []


def test_sigkill_mid_unpack_leaves_no_staging_dir_and_the_next_run_works(
        pytester: pytest.Pytester, smol_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    pytester.makepyfile(GUEST_TEST)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *NS], cwd=pytester.path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any((cache / "baselines").glob(".unpack-*/rootfs/*")), what="the unpack")
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # pytest alone: its unpacking helper is orphaned
        proc.wait(timeout=30)
    assert staging_dirs(cache), "the kill came too late to test anything"
    pytester.runpytest_subprocess(*NS).assert_outcomes(passed=1)
    assert staging_dirs(cache) == [], "the killed run's staging dir is still in the cache"


def test_sigkill_mid_warm_baseline_setup_then_the_next_run_works(
        pytester: pytest.Pytester, smol_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    pytester.makeconftest("""
        def pytest_smolvm_prepare_baseline(vm, config):
            vm.exec("dd if=/dev/urandom of=/opt/warm bs=1M count=24 2>/dev/null", check=True)
    """)
    pytester.makepyfile("""
        def test_guest(smol_vm):
            assert smol_vm.exec("wc -c < /opt/warm").stdout.strip() == str(24 << 20)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *NS], cwd=pytester.path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any((cache / "baselines").glob(".warm-*/rootfs/*")), what="the warm export")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert any(name.startswith(".warm-") for name in staging_dirs(cache)), "the kill came too late"
    pytester.runpytest_subprocess(*NS).assert_outcomes(passed=1)
    assert staging_dirs(cache) == [], "the killed run's warm staging dir is still in the cache"


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_unpacked_baseline_is_unpacked_again(pytester: pytest.Pytester, smol_state: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    pytester.makepyfile(GUEST_TEST)
    pytester.runpytest_subprocess(*NS).assert_outcomes(passed=1)
    [marker] = (cache / "baselines").glob("*/image.json")
    data = bytearray(marker.read_bytes())
    if damage == "truncated":
        del data[len(data) // 2:]
    else:
        data[0] ^= 0xFF
    marker.write_bytes(bytes(data))
    result = pytester.runpytest_subprocess(*NS)
    result.assert_outcomes(passed=1)  # taken as unfinished: moved aside, removed, unpacked again
    assert staging_dirs(cache) == []


class _FailingDisk(io.RawIOBase):
    """A baseline file whose read fails (EIO) right after one whole tar member."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if not self._data:
            raise OSError(errno.EIO, "Input/output error")
        chunk, self._data = self._data, b""
        return chunk


@pytest.mark.parametrize("error", ["EIO", "truncated gzip"])
def test_a_read_error_mid_baseline_is_not_taken_for_its_end(tmp_path: Path, error: str) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name in ("first", "second"):
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"data"))
    whole = raw.getvalue()
    if error == "EIO":
        stream: Any = _FailingDisk(whole[:1024])  # the first member, then the disk fails
    else:  # every byte but the gzip trailer (CRC and size): the tar inside reads whole
        stream = decompressed(io.BytesIO(gzip.compress(whole)[:-8]))
    with pytest.raises(UsageError, match=r"^--smol-baseline: .*reading the stream failed"):
        apply_layer(stream, tmp_path, squash_owner=True)
