"""A registry that fails mid-pull: 5xx answers, connections dropped mid-layer, a damaged or
truncated blob in the cache, and pytest SIGKILLed while a layer downloads.

Each ends in a one-line error naming the image (or in a retry), leaves no partial file in the
cache, and the next pull or run works.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_smolvm.baselines import cache as baselines
from pytest_smolvm.baselines.oci import store
from pytest_smolvm.baselines.oci.pull import resolve_image
from pytest_smolvm.errors import UsageError
from pytest_smolvm.session.settings import Settings
from tests.faults.conftest import wait_for
from tests.registry_fixtures import Images, no_partial_files
from tests.registry_server import ProxyConfig, proxy


def _layer(images: Images) -> str:
    manifest = json.loads(images.registry._call(
        "GET", f"/v2/acc/alpine/manifests/{images.alpine}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).read())
    return str(manifest["layers"][0]["digest"])


@pytest.mark.parametrize("fault", ["503", "500", "dropped"])
def test_a_registry_failing_mid_pull_is_a_clear_error_then_the_next_pull_works(
        oci_registry: Images, oci_cache: Path, fault: str) -> None:
    layer = _layer(oci_registry)
    config = ProxyConfig(oci_registry.host)
    if fault == "dropped":
        config.blob_drops = 5  # every try of the layer: the manifest and config came whole
    else:
        config.blob_statuses = [int(fault)] * 5
    with proxy(config) as host:
        reference = f"{host}/acc/alpine:1"
        with pytest.raises(UsageError) as info:
            resolve_image(reference, Settings())
        message = str(info.value)
        assert message.startswith(f"--smol-baseline={reference}: ") and "\n" not in message
        assert (f"HTTP {fault}" if fault != "dropped" else "broke off") in message, message
        assert not store.has(layer) and no_partial_files(oci_cache) == []
        # the registry is well again: the same reference pulls and unpacks
        config.blob_statuses, config.blob_drops = [], 0
        base = resolve_image(reference, Settings())
        assert store.has(layer)
        assert (baselines.unpack(base).path / "bin" / "busybox").is_file()
    assert no_partial_files(oci_cache) == []


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_blob_damaged_in_the_cache_is_a_clear_error_and_the_next_run_pulls_it_again(
        oci_registry: Images, oci_cache: Path, damage: str) -> None:
    reference = f"{oci_registry.host}/acc/alpine:1"
    base = resolve_image(reference, Settings())
    blob = store.blob_path(_layer(oci_registry))
    data = bytearray(blob.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 3:]
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    damaged = r"cached blob sha256:[0-9a-f]{12} is damaged; it was removed from the cache"
    with pytest.raises(UsageError, match=damaged) as info:
        baselines.unpack(base)
    assert "\n" not in str(info.value)
    assert not (oci_cache / "baselines" / base.path.name[:32]).exists()  # type: ignore[union-attr]
    assert no_partial_files(oci_cache) == []
    # the next run: the damaged blob is not used again; it is pulled again and the unpack works
    again = resolve_image(reference, Settings())
    assert (baselines.unpack(again).path / "bin" / "busybox").is_file()


def test_sigkill_mid_pull_leaves_no_partial_blob_and_the_next_run_pulls(
        pytester: pytest.Pytester, smol_state: Path, oci_registry: Images, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    config = ProxyConfig(oci_registry.host, chunk_delay=0.05)  # ~20 s for the layer: killed long before
    pytester.makepyfile("""
        def test_guest(smol_vm):
            assert smol_vm.exec("cat /etc/alpine-release").exit_code == 0
    """)
    with proxy(config) as host:
        args = ["-p", "no:cacheprovider", "--smol-backend=namespace", f"--smol-baseline={host}/acc/alpine:1"]
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=pytester.path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: any(p.name.startswith(".tmp-") and p.stat().st_size > (1 << 18)
                                  for p in (cache / "oci" / "blobs" / "sha256").glob(".tmp-*")))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        config.chunk_delay = 0.0
        pytester.runpytest_subprocess(*args).assert_outcomes(passed=1)
    assert no_partial_files(cache) == [], "the killed pull's partial layer is still in the cache"

