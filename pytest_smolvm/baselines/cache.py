"""The host's cache of unpacked baselines: each digest unpacked once per host, and derived ones.

Unpacking happens once per host per digest, under a file lock, into a temporary dir that is
renamed into place: concurrent first use from several processes is safe, and an interrupted
unpack never leaves a half tree that looks finished.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_smolvm.baselines import manifest
from pytest_smolvm.baselines.archive import apply_layer, open_maybe_compressed, unpack_image_archive
from pytest_smolvm.baselines.baseline import Baseline, Rootfs
from pytest_smolvm.errors import SmolVMWarning, UsageError
from pytest_smolvm.host.paths import cache_dir
from pytest_smolvm.untrusted.walk import rmtree


def unpack(baseline: Baseline, *, by: str = "main") -> Rootfs:
    """The baseline as a rootfs tree, unpacked at most once per host per digest."""
    if baseline.kind == "registry" and baseline.path is None:
        raise UsageError(f"--smol-baseline={baseline.reference}: a registry reference must be pinned "
                         "(pytest_smolvm.baselines.oci.pull.resolve_image) before it can be unpacked")
    assert baseline.path is not None
    if baseline.kind == "rootfs-dir":
        return Rootfs(baseline.path)
    if baseline.kind not in ("bundled", "rootfs-tar", "image-archive", "registry"):
        raise UsageError(f"--smol-baseline={baseline.reference}: a {baseline.kind} baseline needs the smol backend")
    # A registry baseline's digest may name a multi-platform index: the tree is this host's manifest.
    key = (baseline.path.name if baseline.kind == "registry" else baseline.digest.split(":", 1)[-1])[:32]
    path = baseline.path

    def fill(rootfs: Path) -> dict[str, Any]:
        if baseline.kind == "registry":
            from pytest_smolvm.baselines.oci.pull import unpack_image

            config = unpack_image(path, rootfs, baseline.reference)
        elif baseline.kind == "image-archive":
            config = unpack_image_archive(path, rootfs)
        else:
            with open_maybe_compressed(path) as stream:
                apply_layer(stream, rootfs, squash_owner=baseline.kind == "bundled")
            config = {}
        return {"reference": baseline.reference, "digest": baseline.digest, "env": config.get("Env") or [],
                "workdir": config.get("WorkingDir") or "/", "user": config.get("User") or ""}

    return _made_once(cache_dir() / "baselines" / key, baseline.reference, fill, baseline, by)


def prepare_derived(key: str, parent: Baseline, parent_rootfs: Rootfs, capture: Callable[[Path], None], *,
                    by: str = "main") -> Rootfs:
    """A rootfs made by ``capture(staging_dir)``, once per host per ``key`` (a warm baseline).

    Same guarantees as :func:`unpack`; it inherits the parent's environment and workdir.
    """
    reference = f"{parent.reference} + setup"
    final = cache_dir() / "baselines" / f"warm-{key[:32]}"

    def fill(rootfs: Path) -> dict[str, Any]:
        capture(rootfs)
        return {"reference": reference, "digest": f"sha256:{key}", "parent": parent.digest,
                "env": [f"{k}={v}" for k, v in parent_rootfs.env.items()], "workdir": parent_rootfs.workdir,
                "user": parent_rootfs.user}

    return _made_once(final, reference, fill, Baseline(reference, "rootfs-dir", final, f"sha256:{key}"), by)


def _made_once(final: Path, what: str, fill: Callable[[Path], dict[str, Any]], logged: Baseline,
               by: str) -> Rootfs:
    """The tree at ``final``, made at most once per host: under a file lock, ``fill`` writes the
    rootfs into a staging dir and returns its image.json; a manifest is written, the dir renamed
    into place, and a line added to the preparations log (as ``logged``, by ``by``).

    A finished tree comes into place whole (image.json is written inside the staging dir first)
    and nothing removes one but a failed check, so a hit needs no lock: every run but a host's
    first takes this path, without importing filelock (on the way to a run's first guest).
    """
    found = _finished(final)
    if found is not None and _intact(final):
        return found
    store = final.parent
    store.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(store / f"{final.name}.lock")):
        found = _finished(final, locked=True)
        if found is not None and _intact(final, locked=True, what=what):
            return found
        started = time.monotonic()
        _remove_orphans(store, final.name)
        staging = store / f"{_staging_prefix(final.name)}-{os.getpid()}"
        try:
            (staging / "rootfs").mkdir(parents=True)
            (staging / "image.json").write_text(json.dumps(fill(staging / "rootfs")))
            manifest.write(staging)
            os.replace(staging, final)
        except BaseException:
            force_rmtree(staging)
            raise
        _log_preparation(store, logged, time.monotonic() - started, by)
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


def _finished(final: Path, *, locked: bool = False) -> Rootfs | None:
    """The finished tree at ``final``, or None. One whose image.json no longer reads (a damaged
    cache: a full disk, a bad block, a hand edit) is not finished: under the lock it is moved
    aside and removed, then unpacked again, rather than failing every run from now on."""
    if not (final / "image.json").is_file():
        return None
    try:
        return _load_rootfs(final)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        if not locked:
            return None
    damaged = final.with_name(f".damaged-{final.name}-{os.getpid()}")
    os.replace(final, damaged)  # at once: no run takes the damaged tree from here on
    force_rmtree(damaged)
    return None


# Trees this process has checked (the cheap check runs once per process per tree).
_checked: set[Path] = set()


def _intact(final: Path, *, locked: bool = False, what: str = "") -> bool:
    """Whether the finished tree at ``final`` passes its manifest's cheap check (once per process).
    Unlocked, a damaged tree only sends the caller to the lock; there it is moved aside and
    removed (to be unpacked again), and the run is told once, with what was wrong."""
    if final in _checked:
        return True
    damage = manifest.check(final)
    if damage is None:
        _checked.add(final)
        return True
    if not locked:
        return False
    warnings.warn(SmolVMWarning(f"the cached baseline {what or final.name} was damaged ({damage}); "
                                f"unpacking it again in {final.parent}"), stacklevel=4)
    damaged = final.with_name(f".damaged-{final.name}-{os.getpid()}")
    os.replace(final, damaged)  # at once: no run takes the damaged tree from here on
    force_rmtree(damaged)
    return False


def _remove_orphans(store: Path, name: str) -> None:
    """Staging (and set-aside) dirs of processes killed mid-unpack (SIGKILL, OOM, a power cut).
    Called under ``name``'s lock, so no live process is filling one; each would stay for good:
    the next unpack's staging dir is named by its own pid."""
    for pattern in (f"{_staging_prefix(name)}-*", f".damaged-{name}-*"):
        for orphan in store.glob(pattern):
            force_rmtree(orphan)


def _staging_prefix(name: str) -> str:
    return f".warm-{name.removeprefix('warm-')}" if name.startswith("warm-") else f".unpack-{name}"


def _load_rootfs(final: Path) -> Rootfs:
    meta = json.loads((final / "image.json").read_text())
    env = dict(item.split("=", 1) for item in meta["env"] if "=" in item)
    return Rootfs(final / "rootfs", env, meta["workdir"], str(meta.get("user") or ""))


def force_rmtree(path: Path) -> None:
    """Remove a tree, read-only dirs and any depth included (a warm export is a guest's tree)."""
    rmtree(path)

