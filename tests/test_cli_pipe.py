"""``pytest-smolvm ls | head`` and ``results ... | head``: a reader that goes away ends the
command quietly (issue 43: a BrokenPipeError traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _with_the_pipe_closed(*args: str, state: Path) -> tuple[int, str]:
    """The command's stdout a pipe whose reader is gone before it writes (as ``head`` is, early)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", *args], stdout=writer,
                              stderr=subprocess.PIPE, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_SMOLVM_STATE_DIR": str(state)})
    finally:
        os.close(writer)
    return done.returncode, done.stderr


@pytest.mark.parametrize("command", ["ls", "results"])
def test_a_closed_pipe_ends_the_command_without_a_traceback(tmp_path: Path, command: str) -> None:
    args = [command]
    if command == "results":
        line = {"v": 1, "function": "t", "case": "", "seed": 1, "episode": 0, "outcome": "passed", "reward": 1.0,
                "baseline_digest": "sha256:aa"}
        (tmp_path / "a.jsonl").write_text(json.dumps(line) + "\n")
        args.append(str(tmp_path / "a.jsonl"))
    code, stderr = _with_the_pipe_closed(*args, state=tmp_path / "state")
    assert stderr == ""
    assert code == 141  # 128 + SIGPIPE, as a command the signal ended
