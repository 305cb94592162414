"""The code standards CI holds us to: mypy --strict and ruff, on the package as shipped."""

from __future__ import annotations

import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tool", [
    [sys.executable, "-m", "mypy", "--strict", "pytest_smolvm"],
    [sys.executable, "-m", "ruff", "check", "pytest_smolvm", "tests", "examples", "benchmarks"],
], ids=["mypy", "ruff"])
def test_clean(tool: list[str]) -> None:
    if find_spec(tool[2]) is None:  # a missing checker is a failure, not a pass
        pytest.fail(f"{tool[2]} is not installed (pip install '.[test]')")
    result = subprocess.run(tool, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
