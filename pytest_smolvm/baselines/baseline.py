"""Baselines: what a reference names, its content digest, and unpacking it once per host.

A baseline reference is a rootfs directory, a rootfs tarball (``.tar``, ``.tar.gz``,
``.tar.zst``), a ``docker save``/OCI archive, a ``.smolmachine`` (smol only) or a registry
reference. No reference means the Alpine rootfs bundled in the smolmachines wheel. A registry
reference is classified here and pinned to a digest (and pulled) by
:func:`pytest_smolvm.baselines.oci.resolve_image`, which needs the settings (auth, offline).

Unpacking happens once per host per digest, under a file lock, into a temporary dir that is
renamed into place: concurrent first use from several processes is safe, and an interrupted
unpack never leaves a half tree that looks finished.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import IO, Any, Literal

from pytest_smolvm.errors import UsageError
from pytest_smolvm.host.paths import cache_dir
from pytest_smolvm.untrusted import confined, hostfs

Kind = Literal["bundled", "rootfs-dir", "rootfs-tar", "image-archive", "smolmachine", "registry"]
BUNDLED_ROOTFS = "agent-rootfs.tar.zst"
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.zstd")
CHUNK = 1 << 20
# A layer is a whole root filesystem: caps far above any image this project runs, still finite.
LAYER_CAPS = hostfs.Caps(max_bytes=64 << 30, max_members=10_000_000, timeout=3600.0)


@dataclass(frozen=True)
class Baseline:
    reference: str  # as the user wrote it; "bundled alpine" for the default
    kind: Kind
    path: Path | None
    digest: str  # "sha256:<hex>"; a registry ref's own text until oci.resolve_image pins it

    @property
    def short_digest(self) -> str:
        return self.digest.split(":", 1)[-1][:12]


@dataclass(frozen=True)
class Rootfs:
    """An unpacked baseline: a read-only tree plus what the image says about its processes."""

    path: Path
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""  # the image config's User ("" = root), for handles that can exec as a user


def bundled_rootfs_tarball(option: str = "--smol-baseline") -> Path:
    spec = find_spec("smol")  # finding, not importing: importing smol touches os.environ
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / BUNDLED_ROOTFS
        if candidate.is_file():
            return candidate
    raise UsageError(f"{option}: no baseline given and the smolmachines wheel's bundled rootfs "
                     f"was not found (pip install smolmachines, or pass {option}=PATH)")


def resolve(reference: str | None, rootdir: Path, *, option: str = "--smol-baseline") -> Baseline:
    """Classify ``reference`` and digest it. Raises UsageError naming ``option`` (what the user wrote)."""
    if not reference:
        tarball = bundled_rootfs_tarball(option)
        return Baseline("bundled alpine", "bundled", tarball, file_digest(tarball))
    check_reference(reference, rootdir, option=option)
    path = _as_path(reference, rootdir)
    if path.exists():
        path = path.resolve()
        if path.is_dir():
            return Baseline(reference, "rootfs-dir", path, tree_digest(path))
        if path.name.endswith(".smolmachine"):
            return Baseline(reference, "smolmachine", path, file_digest(path))
        kind: Kind = "image-archive" if _is_image_archive(path) else "rootfs-tar"
        return Baseline(reference, kind, path, file_digest(path))
    return Baseline(reference, "registry", None, reference)


def _as_path(reference: str, rootdir: Path) -> Path:
    path = Path(os.path.expanduser(reference))
    return path if path.is_absolute() else rootdir / path


def check_reference(reference: str | None, rootdir: Path, *, option: str = "--smol-baseline") -> None:
    """What :func:`resolve` would refuse, found without reading any file: a startup check."""
    if not reference:
        return
    path = _as_path(reference, rootdir)
    if path.exists():
        if not path.is_dir() and not path.name.endswith((*TAR_SUFFIXES, ".smolmachine")):
            raise UsageError(f"{option}={reference}: not a rootfs dir or an archive "
                             f"({', '.join(TAR_SUFFIXES)}, .smolmachine)")
    elif _looks_like_path(reference):
        raise UsageError(f"{option}={reference}: no such file or directory")
    else:
        from pytest_smolvm.baselines.oci.reference import parse

        parse(reference, option)  # a malformed image name fails at startup, not at the first guest


def _looks_like_path(reference: str) -> bool:
    return (reference.startswith(("/", "./", "../", "~")) or reference.endswith(TAR_SUFFIXES)
            or reference.endswith(".smolmachine") or (os.sep in reference and ":" not in reference
            and "." not in reference.split("/", 1)[0]))


# --------------------------------------------------------------------------- digests


def _memo_path() -> Path:
    return cache_dir() / "digests.json"


def _memo_load() -> dict[str, str]:
    try:
        data = json.loads(_memo_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _memo_store(key: str, digest: str) -> None:
    memo = _memo_load()
    memo[key] = digest
    path = _memo_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".digests.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, path)
    except OSError:
        pass  # the memo only saves time


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes, memoised by (path, inode, size, mtime)."""
    st = path.stat()
    key = f"{path}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    memo = _memo_load()
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    digest = f"sha256:{h.hexdigest()}"
    _memo_store(key, digest)
    return digest


def tree_digest(root: Path) -> str:
    """A digest of a directory tree's names, types, modes, sizes, mtimes and link targets.

    Cheap (no file contents are read): a rootfs dir is used in place as a read-only layer,
    so what matters is noticing that it changed.
    """
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            link = os.readlink(full) if stat.S_ISLNK(st.st_mode) else ""
            rel = os.path.relpath(full, root)
            h.update(f"{rel}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{link}\n".encode(errors="surrogateescape"))
    return f"sha256:{h.hexdigest()}"


# --------------------------------------------------------------------------- unpacking


def unpack(baseline: Baseline, *, by: str = "main") -> Rootfs:
    """The baseline as a rootfs tree, unpacked at most once per host per digest."""
    if baseline.kind == "registry" and baseline.path is None:
        raise UsageError(f"--smol-baseline={baseline.reference}: a registry reference must be pinned "
                         "(pytest_smolvm.baselines.oci.resolve_image) before it can be unpacked")
    assert baseline.path is not None
    if baseline.kind == "rootfs-dir":
        return Rootfs(baseline.path)
    if baseline.kind not in ("bundled", "rootfs-tar", "image-archive", "registry"):
        raise UsageError(f"--smol-baseline={baseline.reference}: a {baseline.kind} baseline needs the smol backend")
    store = cache_dir() / "baselines"
    # A registry baseline's digest may name a multi-platform index: the tree is this host's manifest.
    key = (baseline.path.name if baseline.kind == "registry" else baseline.digest.split(":", 1)[-1])[:32]
    final = store / key
    # A finished tree comes into place whole (a staging dir renamed, image.json written inside it
    # first) and nothing removes one, so a hit needs no lock: every run but a host's first takes
    # this path, without importing filelock (~16 ms on the way to a run's first guest).
    if (final / "image.json").is_file():
        return _load_rootfs(final)
    store.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(store / f"{key}.lock")):
        if (final / "image.json").is_file():
            return _load_rootfs(final)
        started = time.monotonic()
        staging = store / f".unpack-{key}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            (staging / "rootfs").mkdir(parents=True)
            if baseline.kind == "registry":
                from pytest_smolvm.baselines.oci import unpack_image

                config = unpack_image(baseline.path, staging / "rootfs", baseline.reference)
            elif baseline.kind == "image-archive":
                config = _unpack_image_archive(baseline.path, staging / "rootfs")
            else:
                with _open_maybe_compressed(baseline.path) as stream:
                    apply_layer(stream, staging / "rootfs", squash_owner=baseline.kind == "bundled")
                config = {}
            (staging / "image.json").write_text(json.dumps({
                "reference": baseline.reference, "digest": baseline.digest,
                "env": config.get("Env") or [], "workdir": config.get("WorkingDir") or "/",
                "user": config.get("User") or ""}))
            os.replace(staging, final)
        except BaseException:
            force_rmtree(staging)
            raise
        elapsed = time.monotonic() - started
        _log_preparation(store, baseline, elapsed, by)
        return _load_rootfs(final)


def prepare_derived(key: str, parent: Baseline, parent_rootfs: Rootfs, capture: Callable[[Path], None], *,
                    by: str = "main") -> Rootfs:
    """A rootfs made by ``capture(staging_dir)``, once per host per ``key`` (a warm baseline).

    Same guarantees as :func:`unpack`: a file lock, a staging dir renamed into place, and a
    line in the preparations log. It inherits the parent's environment and workdir.
    """
    store = cache_dir() / "baselines"
    final = store / f"warm-{key[:32]}"
    if (final / "image.json").is_file():
        return _load_rootfs(final)  # no lock for a hit: see unpack
    store.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(store / f"warm-{key[:32]}.lock")):
        if (final / "image.json").is_file():
            return _load_rootfs(final)
        started = time.monotonic()
        staging = store / f".warm-{key[:32]}-{os.getpid()}"
        force_rmtree(staging)
        try:
            (staging / "rootfs").mkdir(parents=True)
            capture(staging / "rootfs")
            (staging / "image.json").write_text(json.dumps({
                "reference": f"{parent.reference} + setup", "digest": f"sha256:{key}", "parent": parent.digest,
                "env": [f"{k}={v}" for k, v in parent_rootfs.env.items()], "workdir": parent_rootfs.workdir,
                "user": parent_rootfs.user}))
            os.replace(staging, final)
        except BaseException:
            force_rmtree(staging)
            raise
        elapsed = time.monotonic() - started
        _log_preparation(store, Baseline(f"{parent.reference} + setup", "rootfs-dir", final, f"sha256:{key}"),
                         elapsed, by)
        return _load_rootfs(final)


PREPARATIONS = "preparations.jsonl"


def _log_preparation(store: Path, baseline: Baseline, seconds: float, by: str) -> None:
    """One line per unpack ever done on this host: who did it and how long it took."""
    line = json.dumps({"digest": baseline.digest, "reference": baseline.reference, "pid": os.getpid(),
                       "worker": by, "seconds": round(seconds, 3),
                       "at": time.time()}) + "\n"
    with open(store / PREPARATIONS, "a") as f:
        f.write(line)


def preparations(digest: str) -> list[dict[str, Any]]:
    """Every recorded preparation of ``digest`` on this host, oldest first."""
    try:
        lines = (cache_dir() / "baselines" / PREPARATIONS).read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("digest") == digest:
            found.append(entry)
    return found


def _load_rootfs(final: Path) -> Rootfs:
    meta = json.loads((final / "image.json").read_text())
    env = dict(item.split("=", 1) for item in meta["env"] if "=" in item)
    return Rootfs(final / "rootfs", env, meta["workdir"], str(meta.get("user") or ""))


def force_rmtree(path: Path) -> None:
    def make_writable(func: Any, failed: str, _exc: Any) -> None:
        os.chmod(os.path.dirname(failed), 0o700)
        func(failed)

    if path.exists():
        shutil.rmtree(path, onerror=make_writable)


def _is_image_archive(path: Path) -> bool:
    import zstandard

    try:
        with _open_maybe_compressed(path) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for i, member in enumerate(tar):
                if member.name.lstrip("./") in ("manifest.json", "index.json", "oci-layout"):
                    return True
                if i > 64:
                    return False
    except (tarfile.TarError, OSError, zstandard.ZstdError) as exc:
        raise UsageError(f"--smol-baseline={path}: not a readable archive: {exc}") from exc
    return False


def _decompressed(raw: IO[bytes]) -> IO[bytes]:
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


class _open_maybe_compressed:
    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - closed in __exit__

    def __enter__(self) -> IO[bytes]:
        return _decompressed(self._file)

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _unpack_image_archive(path: Path, dest: Path) -> dict[str, Any]:
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
            apply_layer(_decompressed(blob), dest, squash_owner=False)
    return dict(config)


def _blob(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return f"blobs/{algorithm}/{hexdigest}"


def apply_layer(stream: IO[bytes], dest: Path, *, squash_owner: bool, what: str = "--smol-baseline",
                caps: hostfs.Caps | None = None, guest_export: bool = False) -> None:
    """Extract one layer over ``dest`` with OCI whiteouts; never writes outside ``dest``.

    The layer may come from a guest (a warm baseline's export): it is unpacked by
    :mod:`pytest_smolvm.untrusted.hostfs`'s rules, which trust nothing in it. Devices and FIFOs are
    skipped (a guest gets its own /dev). A ``guest_export`` (a warm root) is normalised too: no
    setuid/setgid bits, no world-writable dir without the sticky bit. Errors are UsageErrors
    naming ``what``.
    """
    policy = hostfs.Policy(what, layer=True, squash_owner=squash_owner, guest_export=guest_export)
    try:
        confined.extract(stream, dest, policy, caps or LAYER_CAPS)
    except hostfs.UnsafeArchive as exc:
        message = str(exc)
        raise UsageError(message if message.startswith(what) else f"{what}: {message}") from exc
