"""The README's first quick-start command: the example suite passes and leaves nothing behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.tools import in_ci

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "n2"])
def test_examples_pass(pytester: pytest.Pytester, smol_state: Path, workers: list[str]) -> None:
    shutil.copytree(EXAMPLES, pytester.path / "examples")
    result = pytester.runpytest_subprocess("examples", "-rs", *workers)
    outcomes = result.parseoutcomes()
    text = result.stdout.str()
    assert outcomes.get("passed", 0) >= 10 and set(outcomes) <= {"passed", "skipped", "warnings"}, text
    # A host without an optional tool (pasta for examples/network): those examples skip, each
    # naming the line that installs it. CI installs them all: there every example runs.
    skips = [line for line in result.stdout.lines if line.startswith("SKIPPED")]
    assert bool(skips) == bool(outcomes.get("skipped")), text
    assert all("apt-get install -y" in line for line in skips), text
    assert not (in_ci() and outcomes.get("skipped")), text
