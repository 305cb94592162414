"""``pytest-smolvm results`` on result files made by real runs of the example eval suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_smolvm.errors import ResultsError
from pytest_smolvm.evals.results.load import cause, read

ROOT = Path(__file__).resolve().parent.parent


def _eval_run(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pytest", "examples/evals", "-q", "-p", "no:cacheprovider",
                    f"--smol-results={out}"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    return out


def _results(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", "results", *args],
                          capture_output=True, text=True, timeout=60)


def test_two_real_runs_are_summarized_and_compared(tmp_path: Path) -> None:
    first, second = _eval_run(tmp_path / "a.jsonl"), _eval_run(tmp_path / "b.jsonl")
    done = _results(str(first), str(second))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("12 episodes") >= 2
    assert "reward mean (a failure without a reward scores 0), 95% bootstrap interval over episodes:" in out
    assert "test_agent[uppercase]" in out and "over 4 pairs" in out
    assert "outcomes: passed 12" in out
    assert f"{second} vs {first}" in out
    assert "different baseline digests" not in out


def test_runs_on_different_baselines_are_said_to_be_so(tmp_path: Path) -> None:
    base = {"v": 1, "function": "t", "case": "", "seed": 1, "episode": 0, "outcome": "passed",
            "reward": 1.0, "baseline_digest": "sha256:aa"}
    (tmp_path / "a.jsonl").write_text(json.dumps(base) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({**base, "baseline_digest": "sha256:bb"}) + "\n")
    done = _results(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    assert "different baseline digests (sha256:aa vs sha256:bb)" in done.stdout


@pytest.mark.parametrize(("content", "said"), [
    ("not json\n", ":1: not a JSON line"),
    ('{"v": 1}\n', ":1: not a pytest-smolvm result line"),
    ('{"v": 99, "function": "t", "outcome": "passed"}\n', ":1: schema version 99 is not one"),
])
def test_a_bad_results_file_is_a_one_line_error_naming_it(tmp_path: Path, content: str, said: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    done = _results(str(bad))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and f"{bad}{said}" in done.stderr
    with pytest.raises(ResultsError):
        read(bad)


@pytest.mark.parametrize(("line", "expected"), [
    ({"outcome": "passed"}, "passed"),
    ({"outcome": "failed", "message": "AssertionError: assert 0.2 > 0.5"}, "failed"),
    ({"outcome": "failed", "message": "ExecError: command timed out after 5s"}, "timeout"),
    ({"outcome": "failed", "message": "guest killed: out of memory (OOM)"}, "oom"),
    ({"outcome": "error", "message": "ProvisionError: could not boot the guest"}, "setup"),
    ({"outcome": "skipped"}, "skipped"),
    ({"outcome": "error", "crashed": True}, "crashed"),
])
def test_each_episode_gets_a_cause(line: dict[str, object], expected: str) -> None:
    assert cause(line) == expected


def test_a_torn_last_line_is_skipped_as_read_results_does(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"v": 1, "function": "t", "outcome": "passed"}) + '\n{"v": 1, "func')
    assert [line["function"] for line in read(path)] == ["t"]
