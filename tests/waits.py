"""Bounded waits the tests share: a condition polled until a deadline, a pytest run started until
its test says it is under way."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def until(condition: Callable[[], bool], seconds: float = 10) -> bool:
    """Whether ``condition()`` came true within ``seconds`` (polled every 10 ms)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def pytest_under_way(args: Sequence[str], cwd: Path, started: Path, seconds: float = 120) -> subprocess.Popen[str]:
    """``python -m pytest ARGS`` in ``cwd``, once its test has written ``started`` (else its
    output in the assertion)."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=cwd, env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    until(lambda: started.exists() or proc.poll() is not None, seconds)
    assert started.exists(), proc.communicate(timeout=60)[0]
    return proc
