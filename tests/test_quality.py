"""The code standards CI holds us to: mypy --strict and ruff, on the package as shipped."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tool", [
    [sys.executable, "-m", "mypy", "--strict", "pytest_smolvm"],
    [sys.executable, "-m", "ruff", "check", "pytest_smolvm", "tests", "examples", "benchmarks"],
], ids=["mypy", "ruff"])
def test_clean(tool: list[str]) -> None:
    if shutil.which(tool[0]) is None:
        pytest.fail(f"{tool[0]} not found")
    result = subprocess.run(tool, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
