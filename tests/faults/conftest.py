"""Fixtures that inject faults for real: small filesystems that fill up, processes to kill."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``small_fs("4m")``: a fresh tmpfs of that size (root only), unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"small-{len(mounted)}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)  # still busy: detached, freed when idle


def wait_for(condition: Callable[[], object], timeout: float = 60, what: str = "the fault's moment") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except OSError:
            pass  # a file that came and went between a listing and a stat
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.01)
