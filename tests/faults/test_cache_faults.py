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


def _damage(rootfs: Path, damage: str) -> None:
    busybox = rootfs / "bin" / "busybox"
    if damage == "truncated":
        os.truncate(busybox, busybox.stat().st_size // 2)
    elif damage == "flipped":  # the same size and mtime: only the bytes (and the ctime) differ
        st = busybox.stat()
        with open(busybox, "r+b") as f:
            f.seek(st.st_size // 2)
            byte = f.read(1)
            f.seek(st.st_size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.utime(busybox, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        (rootfs / "etc" / "alpine-release").unlink()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "deleted"])
def test_a_damaged_unpacked_rootfs_is_found_and_unpacked_again_saying_so_once(
        pytester: pytest.Pytester, smol_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        damage: str) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    pytester.makepyfile(GUEST_TEST)
    pytester.runpytest_subprocess(*NS).assert_outcomes(passed=1)
    [tree] = [p.parent for p in (cache / "baselines").glob("*/image.json")]
    second = pytester.runpytest_subprocess(*NS)  # an intact tree: used as it is, no word
    second.assert_outcomes(passed=1)
    assert "was damaged" not in second.stdout.str()
    _damage(tree / "rootfs", damage)
    result = pytester.runpytest_subprocess(*NS)
    result.assert_outcomes(passed=1, warnings=1)
    assert result.stdout.str().count("was damaged") == 1, result.stdout.str()
    result.stdout.fnmatch_lines(["*cached baseline * was damaged (/*busybox*" if damage != "deleted"
                                 else "*cached baseline * was damaged (/etc/alpine-release is missing)*"])
    assert staging_dirs(cache) == []
    after = pytester.runpytest_subprocess(*NS)
    after.assert_outcomes(passed=1)
    assert "was damaged" not in after.stdout.str()


def test_doctor_verifies_every_file_of_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Damage the cheap check cannot see (a flipped byte with every stamp as recorded, as a bad
    block leaves it) is found by the full verification ``pytest-smolvm doctor`` runs."""
    from pytest_smolvm.backends.smol.doctor import Report, check_cache
    from pytest_smolvm.baselines import cache as cache_mod
    from pytest_smolvm.baselines import manifest
    from pytest_smolvm.baselines.baseline import resolve

    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(tmp_path / "cache"))
    rootfs = cache_mod.unpack(resolve(None, tmp_path)).path
    out = io.StringIO()
    assert check_cache(Report(out)) == 0
    assert "1 cached baseline verified" in out.getvalue(), out.getvalue()
    _damage(rootfs, "flipped")
    tree = rootfs.parent
    entries = manifest.load(tree)
    assert entries is not None
    for entry in entries:  # as if the stamps had never moved: the cheap check passes
        if entry["p"] == "bin/busybox":
            st = (rootfs / "bin" / "busybox").stat()
            entry["t"] = [st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    manifest._save(tree, entries)
    assert manifest.check(tree) is None
    out = io.StringIO()
    assert check_cache(Report(out)) == 1
    assert "/bin/busybox does not have the bytes it was unpacked with" in " ".join(out.getvalue().split())
