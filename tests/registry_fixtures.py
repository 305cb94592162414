"""Session fixtures: a public and a private (htpasswd) registry on 127.0.0.1 holding the test images."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_smolvm.baselines.oci.pull import host_platform
from tests import tools
from tests.registry_server import (
    OCI_INDEX,
    Registry,
    alpine_layer,
    digest_of,
    start_registry,
    stop_registry,
    tar_layer,
)

IMAGE_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ACC_IMAGE=1"]
PRIVATE_USER = ("alice", "s3cret-pw")


@dataclass
class Images:
    registry: Registry
    alpine: str  # manifest digest of acc/alpine:1
    multi: str  # index digest of acc/multi:1
    multi_host: str  # the index's entry for this host
    layers: str  # manifest digest of acc/layers:1 (two layers, whiteouts, an opaque dir, a config)

    @property
    def host(self) -> str:
        return self.registry.host


@pytest.fixture(scope="session")
def alpine_layer_bytes() -> bytes:
    return alpine_layer()


@pytest.fixture(scope="session")
def oci_registry(tmp_path_factory: pytest.TempPathFactory, alpine_layer_bytes: bytes) -> Iterator[Images]:
    registry = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        alpine = registry.push_image("acc/alpine", "1", [alpine_layer_bytes], {"Env": IMAGE_ENV})
        arch, variant = host_platform()
        other = "s390x" if arch != "s390x" else "amd64"
        host_digest = registry.push_image("acc/multi", "host", [alpine_layer_bytes], {"Env": IMAGE_ENV}, arch)
        other_digest = registry.push_image("acc/multi", "other", [tar_layer([("OTHER-ARCH", b"wrong platform\n")])],
                                           {}, other)
        host_platform_entry = {"os": "linux", "architecture": arch, **({"variant": variant} if variant else {})}
        sizes = {d: len(registry._call("GET", f"/v2/acc/multi/manifests/{d}",
                                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).read())
                 for d in (host_digest, other_digest)}
        multi = registry.push_manifest("acc/multi", "1", {
            "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": other_digest,
                 "size": sizes[other_digest], "platform": {"os": "linux", "architecture": other}},
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": host_digest,
                 "size": sizes[host_digest], "platform": host_platform_entry}]})
        second = tar_layer([
            ("etc/.wh.motd", b""),  # removes /etc/motd
            ("etc/apk/", None), ("etc/apk/.wh..wh..opq", b""), ("etc/apk/only-this", b"opaque\n"),
            ("srv/", None), ("srv/app/", None), ("srv/app/hello.txt", b"from layer two\n")])
        layers = registry.push_image("acc/layers", "1", [alpine_layer_bytes, second], {
            "Env": [*IMAGE_ENV, "GREETING=hello from the image"], "WorkingDir": "/srv/app", "User": "nobody"})
        yield Images(registry, alpine, multi, host_digest, layers)
    finally:
        stop_registry(registry)


@pytest.fixture(scope="session")
def private_registry(tmp_path_factory: pytest.TempPathFactory, alpine_layer_bytes: bytes) -> Iterator[Registry]:
    """A registry where every request needs a password (htpasswd, bcrypt), holding acc/private:1."""
    tools.require("htpasswd", "a private registry's password file")
    workdir = tmp_path_factory.mktemp("private-registry")
    htpasswd = workdir / "htpasswd"
    entry = subprocess.run(["htpasswd", "-Bbn", *PRIVATE_USER], capture_output=True, text=True, check=True)
    htpasswd.write_text(entry.stdout)
    registry = start_registry(workdir, htpasswd=htpasswd)
    registry.credentials = PRIVATE_USER
    try:
        registry.push_image("acc/private", "1", [alpine_layer_bytes], {"Env": IMAGE_ENV})
        registry.credentials = None  # from here on the registry is used as a client without a password
        yield registry
    finally:
        stop_registry(registry)


@pytest.fixture
def oci_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh cache and an empty Docker config, so a test sees only what it pulls and configures."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    monkeypatch.delenv("PYTEST_SMOLVM_REGISTRY_AUTH", raising=False)
    return cache


def no_partial_files(cache: Path) -> list[str]:
    """Temporary or staging files left in the cache (there must be none after any failure)."""
    return [str(p) for p in cache.rglob("*") if p.name.startswith((".tmp-", ".unpack-", ".tags."))]


__all__ = ["IMAGE_ENV", "PRIVATE_USER", "Images", "digest_of", "no_partial_files"]
