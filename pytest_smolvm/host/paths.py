"""Where pytest-smolvm keeps things on the host, outside any project: a cache, a state dir, and a
runtime dir for what cannot outlive the host's boot anyway."""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

ROOT_RUNTIME_DIR = "/run/pytest-smolvm"  # root's runtime dir where /run is a tmpfs


def _shm_runtime_dir(euid: int) -> str:
    return f"/dev/shm/pytest-smolvm-{euid}"


def cache_dir() -> Path:
    """Unpacked baselines and digests: reusable, safe to delete when nothing runs."""
    return _private(_cache_path())


def state_dir() -> Path:
    """The host-wide registry of live guests and their scratch dirs."""
    return _private(_state_path())


def _cache_path() -> str:
    explicit = os.environ.get("PYTEST_SMOLVM_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pytest-smolvm")


def _state_path() -> str:
    explicit = os.environ.get("PYTEST_SMOLVM_STATE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "pytest-smolvm")


def guest_tree_homes() -> frozenset[str]:
    """Every directory of this host where guest-written trees may lie (warm baselines in the
    cache, guests' scratch in the state and runtime dirs), as absolute paths, both as spelled
    and resolved. Pure: made nowhere, so a run that asks costs nothing else."""
    xdg_runtime = os.environ.get("XDG_RUNTIME_DIR")
    candidates = [_cache_path(), _state_path(), ROOT_RUNTIME_DIR, _shm_runtime_dir(os.geteuid())]
    if xdg_runtime and os.path.isabs(xdg_runtime):
        candidates.append(os.path.join(xdg_runtime, "pytest-smolvm"))
    spelled = [os.path.abspath(each) for each in candidates]  # as the dirs are made: no ~ expansion
    return frozenset(spelled + [os.path.realpath(each) for each in spelled])


def _private(path: str) -> Path:
    """``path``, made 0700 if this user owns it (created so if missing).

    Baselines unpacked from guests and images live under it: even normalised, a tree a guest
    wrote is no business of the host's other users, and a 0700 top keeps them out of every
    subdirectory whatever mode it was made with.
    """
    try:
        os.makedirs(path, 0o700, exist_ok=True)
        st = os.stat(path)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    except OSError:
        pass  # read-only or foreign: whoever uses it reports the error, naming the path
    return Path(path)


def runtime_dir() -> Path:
    """Records and scratch dirs of guests that are only processes and mounts of this host.

    Nothing of such a guest survives a reboot, so neither need its records: they go to a
    tmpfs, where a record's save costs a fraction of what it costs on a disk filesystem (three
    per guest; docs/performance.md). The XDG runtime dir if the session
    has one; else ``/run`` for root where it is a tmpfs; else a dir of this user's own in
    ``/dev/shm``; else the state dir. Guests that outlive the host (smol machines, kept ones
    included) stay in the state dir. ``PYTEST_SMOLVM_STATE_DIR``, when set, holds both.
    """
    return _runtime_dir(os.environ.get("PYTEST_SMOLVM_STATE_DIR"), os.environ.get("XDG_RUNTIME_DIR"),
                        os.geteuid(), state_dir())


@functools.lru_cache(maxsize=8)
def _runtime_dir(explicit_state: str | None, xdg_runtime: str | None, euid: int, state: Path) -> Path:
    if explicit_state:
        return state
    if xdg_runtime and os.path.isabs(xdg_runtime) and os.path.isdir(xdg_runtime):
        return Path(xdg_runtime) / "pytest-smolvm"
    if euid == 0 and _is_tmpfs("/run"):
        return Path(ROOT_RUNTIME_DIR)
    if _is_tmpfs("/dev/shm"):
        own = _own_private_dir(_shm_runtime_dir(euid), euid)
        if own is not None:
            return own
    return state


def _is_tmpfs(path: str) -> bool:
    """Is ``path`` itself the mount point of a tmpfs (per /proc/self/mounts)?"""
    try:
        with open("/proc/self/mounts") as f:
            return any(fields[1] == path and fields[2] == "tmpfs" for fields in (line.split() for line in f)
                       if len(fields) > 2)
    except OSError:
        return False


def _own_private_dir(path: str, euid: int) -> Path | None:
    """``path`` as a dir only ``euid`` can enter, made if missing; None if anyone else could have
    made or can change it (/dev/shm is writable by every user: never follow what is there)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != euid or st.st_mode & 0o077:
        return None
    return Path(path)
