"""Baseline archives: compressed tarballs, docker-save/OCI archives, and image layers applied.

Every layer is unpacked by the confined unpacker (:mod:`pytest_smolvm.untrusted.confined`): a
layer may come from a registry, a user's file or a guest's warm export, and none is trusted.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from typing import IO, Any

from pytest_smolvm.errors import UnsafeArchive, UsageError
from pytest_smolvm.untrusted import confined, rules

# A layer is a whole root filesystem: caps far above any image this project runs, still finite.
LAYER_CAPS = rules.Caps(max_bytes=64 << 30, max_members=10_000_000, timeout=3600.0)



def is_image_archive(path: Path) -> bool:
    import zstandard

    try:
        with open_maybe_compressed(path) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for i, member in enumerate(tar):
                if member.name.lstrip("./") in ("manifest.json", "index.json", "oci-layout"):
                    return True
                if i > 64:
                    return False
    except (tarfile.TarError, OSError, zstandard.ZstdError) as exc:
        raise UsageError(f"--smol-baseline={path}: not a readable archive: {exc}") from exc
    return False


def decompressed(raw: IO[bytes]) -> IO[bytes]:
    head = raw.read(4)
    rest: Any = _Prefixed(head, raw)
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=rest)  # type: ignore[return-value]
    if head == b"\x28\xb5\x2f\xfd":
        import zstandard  # imported when needed: this module is on the plugin's startup path

        return zstandard.ZstdDecompressor().stream_reader(rest)
    return rest  # type: ignore[no-any-return]


class _Prefixed(io.RawIOBase):
    """A stream with a few already-read bytes put back in front."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rest.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class open_maybe_compressed:
    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - closed in __exit__

    def __enter__(self) -> IO[bytes]:
        return decompressed(self._file)

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def unpack_image_archive(path: Path, dest: Path) -> dict[str, Any]:
    """Apply a docker-save or OCI archive's layers in order; returns the image config."""
    with tarfile.open(path, mode="r:*") as outer:
        names = {m.name.lstrip("./"): m for m in outer.getmembers()}

        def read_json(name: str) -> Any:
            member = names.get(name)
            extracted = outer.extractfile(member) if member else None
            if extracted is None:
                raise UsageError(f"--smol-baseline={path}: archive has no {name}")
            return json.load(extracted)

        if "manifest.json" in names:
            manifest = read_json("manifest.json")[0]
            layers, config_name = manifest["Layers"], manifest["Config"]
        else:
            index = read_json("index.json")
            manifest = read_json(_blob(index["manifests"][0]["digest"]))
            while "manifests" in manifest:  # a multi-platform index: take the first entry
                manifest = read_json(_blob(manifest["manifests"][0]["digest"]))
            layers = [_blob(layer["digest"]) for layer in manifest["layers"]]
            config_name = _blob(manifest["config"]["digest"])
        config = read_json(config_name).get("config") or {}
        for layer in layers:
            member = names.get(layer.lstrip("./"))
            blob = outer.extractfile(member) if member else None
            if blob is None:
                raise UsageError(f"--smol-baseline={path}: layer {layer} is missing from the archive")
            apply_layer(decompressed(blob), dest, squash_owner=False)
    return dict(config)


def _blob(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return f"blobs/{algorithm}/{hexdigest}"


def apply_layer(stream: IO[bytes], dest: Path, *, squash_owner: bool, what: str = "--smol-baseline",
                caps: rules.Caps | None = None, guest_export: bool = False) -> None:
    """Extract one layer over ``dest`` with OCI whiteouts; never writes outside ``dest``.

    The layer may come from a guest (a warm baseline's export): it is unpacked by
    :mod:`pytest_smolvm.untrusted.hostfs`'s rules, which trust nothing in it. Devices and FIFOs are
    skipped (a guest gets its own /dev). A ``guest_export`` (a warm root) is normalised too: no
    setuid/setgid bits, no world-writable dir without the sticky bit. Errors are UsageErrors
    naming ``what``.
    """
    policy = rules.Policy(what, layer=True, squash_owner=squash_owner, guest_export=guest_export)
    try:
        confined.extract(stream, dest, policy, caps or LAYER_CAPS)
    except UnsafeArchive as exc:
        message = str(exc)
        raise UsageError(message if message.startswith(what) else f"{what}: {message}") from exc
