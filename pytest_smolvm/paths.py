"""Where pytest-smolvm keeps things on the host: one cache and one state dir, outside any project."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Unpacked baselines and digests: reusable, safe to delete when nothing runs."""
    explicit = os.environ.get("PYTEST_SMOLVM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pytest-smolvm"


def state_dir() -> Path:
    """The host-wide registry of live guests and their scratch dirs."""
    explicit = os.environ.get("PYTEST_SMOLVM_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "pytest-smolvm"
