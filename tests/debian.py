"""A Debian baseline for the tests that need a common image's user tools (Inspect's checks).

Built once per host with debootstrap (``minbase``: ~50 s, ~200 MB) from the Debian mirror apt
already uses, and kept in a cache of the tests' own, so a CI run builds it once (its workers wait
on a lock) and a developer's later runs reuse it. Needs root (debootstrap mounts and chroots);
without root or without the mirror the tests that ask for it skip, and fail under CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.tools import in_ci, missing, require

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"


def cache_root() -> Path:
    # Not XDG_CACHE_HOME: fixtures point that at a per-session dir, and this tree is worth keeping.
    # No "smolvm" in the path: debootstrap mounts /proc in its target while it builds, and the leak
    # checks of tests running beside it read every mount whose line names smolvm as a leaked guest's.
    return Path(os.path.expanduser("~")) / ".cache" / "psvm-test-baselines"


def debian_rootfs() -> Path:
    """The tree (a rootfs directory baseline), built on first use."""
    debootstrap = require("debootstrap", "a Debian baseline for Inspect's checks and useradd")
    if os.geteuid() != 0:
        missing("root", "debootstrap builds the Debian baseline as root")
    from filelock import FileLock

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"debian-{SUITE}-minbase"
    with FileLock(str(root / f"debian-{SUITE}.lock")):
        if (final / "etc" / "debian_version").is_file():
            return final
        staging = root / f".debian-{SUITE}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        done = subprocess.run([debootstrap, "--variant=minbase", SUITE, str(staging), MIRROR],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            tail = " ".join(done.stdout.splitlines()[-2:] + done.stderr.splitlines()[-2:])[:300]
            message = f"debootstrap {SUITE} from {MIRROR} failed: {tail}"
            if in_ci():
                raise AssertionError(message)
            import pytest

            pytest.skip(message)
        os.replace(staging, final)
    return final
