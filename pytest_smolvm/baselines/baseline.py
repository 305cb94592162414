"""Baselines: what a reference names, and its content digest.

A baseline reference is a rootfs directory, a rootfs tarball (``.tar``, ``.tar.gz``,
``.tar.zst``), a ``docker save``/OCI archive, a ``.smolmachine`` (smol only) or a registry
reference. No reference means the Alpine rootfs bundled in the smolmachines wheel. A registry
reference is classified here and pinned to a digest (and pulled) by
:func:`pytest_smolvm.baselines.oci.pull.resolve_image`, which needs the settings (auth, offline).
Unpacking a baseline is :mod:`~pytest_smolvm.baselines.cache`'s job.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

from pytest_smolvm.baselines.archive import is_image_archive
from pytest_smolvm.errors import UsageError
from pytest_smolvm.host.paths import cache_dir

Kind = Literal["bundled", "rootfs-dir", "rootfs-tar", "image-archive", "smolmachine", "registry"]

BUNDLED_ROOTFS = "agent-rootfs.tar.zst"
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.zstd")
CHUNK = 1 << 20



@dataclass(frozen=True)
class Baseline:
    reference: str  # as the user wrote it; "bundled alpine" for the default
    kind: Kind
    path: Path | None
    digest: str  # "sha256:<hex>"; a registry ref's own text until oci.pull.resolve_image pins it

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
            if not in_root_exists(path, "/bin/sh"):  # every string exec runs it: say so once, here
                raise UsageError(f"{option}={reference}: not a root filesystem: no /bin/sh")
            return Baseline(reference, "rootfs-dir", path, tree_digest(path))
        if path.name.endswith(".smolmachine"):
            return Baseline(reference, "smolmachine", path, file_digest(path))
        kind: Kind = "image-archive" if is_image_archive(path) else "rootfs-tar"
        return Baseline(reference, kind, path, file_digest(path))
    return Baseline(reference, "registry", None, reference)


def in_root_exists(root: Path, guest_path: str, *, hops: int = 40) -> bool:
    """Whether ``guest_path`` names a file in the tree ``root`` as a guest rooted there sees it.

    Its symlinks are followed as the guest would follow them (an absolute target from ``root``, a
    ``..`` stopping at it), so a merged-/usr rootfs whose ``/bin`` links to ``/usr/bin`` counts,
    and no link sends the look-up to the host's own ``/bin``.
    """
    todo = [part for part in guest_path.split("/") if part]
    done: list[str] = []
    while todo:
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = root.joinpath(*done, part)
        if candidate.is_symlink():
            hops -= 1
            if hops < 0:
                return False
            target = os.readlink(candidate)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p] + todo
        elif candidate.exists():
            done.append(part)
        else:
            return False
    return bool(done) and not root.joinpath(*done).is_dir()


def _as_path(reference: str, rootdir: Path) -> Path:
    path = Path(os.path.expanduser(reference))
    return path if path.is_absolute() else rootdir / path


def check_reference(reference: str | None, rootdir: Path, *, option: str = "--smol-baseline") -> None:
    """What :func:`resolve` would refuse, found without reading any file: a startup check."""
    if reference is None:
        return
    if not reference.strip():  # an unset shell variable, most likely: the default would hide it
        raise UsageError(f"{option}: expected a rootfs dir, an archive or an image name, got an empty value "
                         "(leave it out for the bundled Alpine)")
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


