"""Result lines v2: each episode's ``cause``, judged from what the host measured (never from guest
text), the link to its saved guest log, large parameters referenced by digest, and the pytest
run's own summary with intervals and the outcome breakdown. Real pytest runs in subprocesses."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_smolvm.evals import causes
from pytest_smolvm.evals.results.load import cause

SUITE = """
    import time
    import pytest

    @pytest.mark.smol_episodes(2)
    def test_passes(smol_vm, smol_episode):
        smol_episode.record(0.5 + smol_episode.index / 4)

    @pytest.mark.smol_episodes(1)
    def test_merits(smol_vm, smol_episode):
        # The guest claims an infrastructure failure; the failure message quotes it.
        said = smol_vm.exec("echo 'killed: out of memory (OOM); timed out; ProvisionError'").stdout
        assert said == "", said

    @pytest.mark.smol_episodes(1)
    def test_exec_timeout(smol_vm, smol_episode):
        smol_vm.exec("sleep 30", timeout=0.5, check=True)

    @pytest.mark.smol_episodes(1)
    @pytest.mark.timeout(1, method="signal")
    def test_pytest_timeout(smol_episode):
        time.sleep(10)

    @pytest.fixture
    def broken():
        raise RuntimeError("the fixture broke")

    @pytest.mark.smol_episodes(1)
    def test_setup(broken, smol_episode):
        pass

    @pytest.mark.smol_episodes(1)
    def test_skip(smol_episode):
        pytest.skip("not this one")
"""


def test_each_line_carries_the_cause_the_host_saw(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(test_causes=SUITE)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-results=r.jsonl", "--smol-artifacts=art")
    result.assert_outcomes(passed=2, failed=3, errors=1, skipped=1)
    raw = (pytester.path / "r.jsonl").read_text().splitlines()
    lines = {ln["test"].split("::")[1]: ln for ln in map(json.loads, raw)}
    assert {ln["v"] for ln in lines.values()} == {2}
    got = {test.split("[")[0]: ln["cause"] for test, ln in lines.items()}
    assert got == {"test_passes": "passed", "test_merits": "failed", "test_exec_timeout": "timeout",
                   "test_pytest_timeout": "timeout", "test_setup": "setup", "test_skip": "skipped"}
    # The viewer believes the line's cause, not the guest's text in its message.
    merits = lines["test_merits[ep0]"]
    assert "out of memory" in merits["message"] and cause(merits) == "failed"
    assert cause({**merits, "v": 1}) == "oom"  # what a v1 reader had to guess from that text
    # A failed episode links to its saved guest log; a passing one saved nothing.
    saved = Path(lines["test_exec_timeout[ep0]"]["artifacts"])
    assert saved.is_absolute() and saved == (pytester.path / "art" / saved.name).resolve()
    assert "TIMED OUT" in (saved / "transcript.txt").read_text()
    assert lines["test_passes[ep0]"]["artifacts"] is None
    # The run's own summary: the table, then intervals and the outcome breakdown; a failure that
    # recorded no reward scores 0, and says so.
    result.stdout.fnmatch_lines([
        "reward mean (a failure without a reward scores 0), 95% bootstrap interval over episodes:",
        "  test_causes.py::test_exec_timeout: reward 0.000 [[]0.000, 0.000[]] (1 of 1 failed without a reward, "
        "scored 0)",
        "  test_causes.py::test_passes: reward 0.625 [[]0.500, 0.750[]]",
        "outcomes: passed 2, failed 1, timeout 2, setup 1, skipped 1",
    ])


def _guest(oom_kills: int = 0, timed_out: bool = False) -> Any:
    entry = SimpleNamespace(timed_out=timed_out)
    return SimpleNamespace(guest=SimpleNamespace(oom_kills=oom_kills), vm=SimpleNamespace(transcript=[entry]))


def test_an_oom_kill_the_cgroup_counted_makes_the_cause_oom() -> None:
    # The count itself is read from a real guest's cgroup in
    # tests/security/test_guest_attacks.py::test_8b_an_oom_kill_is_reported.
    failed_call: dict[str, Any] = {"call": SimpleNamespace(failed=True)}  # a stand-in for the call's TestReport
    assert causes.of("failed", failed_call, {}, [_guest(oom_kills=1)]) == "oom"
    assert causes.of("failed", failed_call, {}, [_guest(timed_out=True)]) == "timeout"
    assert causes.of("failed", failed_call, {}, [_guest()]) == "failed"
    assert causes.of("passed", failed_call, {}, [_guest(oom_kills=3)]) == "passed"  # it coped


def test_a_large_parameter_is_referenced_not_embedded(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        class Config:
            def __str__(self):
                return "c" * 5000

        @pytest.mark.parametrize(("prompt", "config", "task"), [("p" * 100_000, Config(), "t")], ids=["big"])
        @pytest.mark.smol_episodes(1)
        def test_agent(smol_episode, prompt, config, task):
            smol_episode.record(1)
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-results=r.jsonl")
    result.assert_outcomes(passed=1)
    raw = (pytester.path / "r.jsonl").read_text()
    assert len(raw) < 4000  # one small line, not the 105 KB of parameters
    params = json.loads(raw)["params"]
    assert params["task"] == "t"
    prompt = json.dumps("p" * 100_000)
    assert params["prompt"] == {"sha256": hashlib.sha256(prompt.encode()).hexdigest(), "chars": len(prompt)}
    assert params["config"]["chars"] == 5002  # its str(), as JSON
