"""The README's first quick-start command: the example suite passes and leaves nothing behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "n2"])
def test_examples_pass(pytester: pytest.Pytester, smol_state: Path, workers: list[str]) -> None:
    shutil.copytree(EXAMPLES, pytester.path / "examples")
    result = pytester.runpytest_subprocess("examples", *workers)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 10 and set(outcomes) <= {"passed", "warnings"}, result.stdout.str()
