"""The ``--smol-results`` file's lines: each appended whole by the process that ran its test, read back whole."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def append_line(path: Path, line: Mapping[str, Any]) -> None:
    """Append one JSON line: one whole ``write()``, ``O_APPEND``, under an exclusive ``flock``.

    The lock is on the results file itself (no lock file to clean up); closing the fd releases it.
    """
    data = (json.dumps(line, allow_nan=False, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        view = memoryview(data)
        while view:  # a regular file takes it in one go; the loop only guards against a short write
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines of a results file (a torn last line, from a host crash, is skipped)."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
    return lines
