"""Episodes, rewards, the results JSONL and the summary: real pytest runs in subprocesses.

Pure functions (seed derivation, pass@k, the line writer) are checked directly as well.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm.evals.episodes import episode_seed
from pytest_smolvm.evals.lines import append_line, read_results
from pytest_smolvm.evals.summary import format_compact, format_table, pass_at_k, summarize

EVALS = Path(__file__).resolve().parent.parent / "examples" / "evals"
REQUIRED = {"v", "test", "function", "case", "params", "episode", "episodes", "seed", "outcome", "cause", "message",
            "reward", "info", "durations", "vms", "backend", "baseline", "baseline_digest", "worker", "run_id",
            "artifacts"}


def _lines(path: Path) -> list[dict[str, Any]]:
    raw = path.read_text().splitlines()
    parsed = [json.loads(line) for line in raw]  # every line is whole, valid JSON
    assert all(line.endswith("}") for line in raw)
    return parsed


def _table_row(stdout: str, function: str) -> list[str]:
    for line in stdout.splitlines():
        if line.startswith(function + " "):
            return line[len(function):].replace("±", " ").split()
    raise AssertionError(f"no summary row for {function} in:\n{stdout}")


# ---------------------------------------------------------------------- pure functions


def test_seed_derivation_is_fixed() -> None:
    # A change here silently changes every user's episodes: it must be deliberate.
    assert [episode_seed(0, i) for i in range(4)] == [649347116, 2019027691, 2780028206, 47239991]
    assert episode_seed(1, 0) != episode_seed(0, 1)
    assert all(0 <= episode_seed(s, i) < 2**32 for s in (-5, 0, 10**30) for i in range(50))


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0  # k = n: did any attempt pass
    assert pass_at_k(4, 1, 1) == 0.25  # k = 1: the pass rate
    assert math.isclose(pass_at_k(5, 2, 2), 1 - math.comb(3, 2) / math.comb(5, 2))


def test_summary_groups_tasks_and_leaves_skips_out() -> None:
    def line(case: str, outcome: str, reward: float | None) -> dict[str, Any]:
        return {"function": "t.py::f", "case": case, "episodes": 2, "outcome": outcome, "reward": reward}

    rows = summarize([line("a", "passed", 1.0), line("a", "failed", 0.0), line("b", "failed", 0.0),
                      line("b", "error", None), line("c", "skipped", None), line("c", "skipped", None),
                      {"function": "t.py::plain", "case": "", "episodes": None, "outcome": "passed", "reward": None}])
    # a test without episodes or rewards has no row; one with several tasks has a row per task too
    assert [(r.function, r.task) for r in rows] == [("t.py::f", None), ("t.py::f", "a"), ("t.py::f", "b"),
                                                     ("t.py::f", "c")]
    row = rows[0]
    assert (row.tasks, row.episodes, row.passed, row.k) == (3, 6, 1, 2)
    assert row.pass_at_1 == 0.25 and row.pass_at_k == 0.5  # tasks a and b attempted; c was all skipped
    # The error without a reward scores 0 (evals/reward.py) and is counted beside the mean.
    assert row.reward_mean == pytest.approx(1 / 4) and row.reward_min == 0.0 and row.reward_max == 1.0
    assert row.reward_se == pytest.approx(math.sqrt((0.75 / 3) / 4)) and row.zeroed == 1
    a, b, c = rows[1:]
    assert (a.tasks, a.episodes, a.passed, a.pass_at_1, a.pass_at_k, a.reward_mean) == (1, 2, 1, 0.5, 1.0, 0.5)
    assert (b.passed, b.pass_at_1, b.reward_mean, b.reward_se, b.zeroed) == (0, 0.0, 0.0, 0.0, 1)
    assert (c.episodes, c.k, c.pass_at_1) == (2, 0, None)  # all skipped: no attempt
    table = format_table(rows)
    assert [line.split()[0] for line in table[1:]] == ["t.py::f", "[a]", "[b]", "[c]"]
    compact = format_compact(rows)
    assert compact[0].startswith("t.py::f: 6 episodes (3 tasks), 1 passed") and compact[1].startswith("  [a]: 2 ep")
    assert format_compact(summarize([line("a", "passed", 1.0)]))[0].startswith("t.py::f: 1 episode (1 task), ")



def test_summary_leaves_rerun_attempts_and_crashed_plain_tests_out() -> None:
    def line(test: str, outcome: str, **more: Any) -> dict[str, Any]:
        return {"test": test, "function": test.split("[")[0], "case": "", "episode": None, "episodes": None,
                "outcome": outcome, "reward": None, **more}

    rows = summarize([line("t.py::f[ep0]", "rerun", episode=0, episodes=2, reward=0.0),
                      line("t.py::f[ep0]", "passed", episode=0, episodes=2, reward=1.0),
                      line("t.py::f[ep1]", "error", episode=1, crashed=True),  # its id names the episode
                      line("t.py::g[a]", "passed", case="a", reward=0.5),
                      line("t.py::g[b]", "error", case="b", crashed=True),  # one of g's tasks: g has rewards
                      line("t.py::plain", "error", crashed=True)])  # no episodes, no reward: no row
    assert [(r.function, r.task, r.episodes, r.passed, r.zeroed) for r in rows] == [
        ("t.py::f", None, 2, 1, 1), ("t.py::g", None, 2, 1, 1), ("t.py::g", "a", 1, 1, 0), ("t.py::g", "b", 1, 0, 1)]
    assert format_compact(rows)[0] == "t.py::f: 2 episodes (1 task), 1 passed, pass@1 0.500, pass@2 1.000, " \
                                      "reward 0.500 ± 0.500 (1 failed without a reward, scored 0)"
    assert ", pass@1 1.000, reward" in format_compact(rows)[2]  # k = 1: pass@1 once

def _writer(path: str, worker: int) -> None:
    for i in range(200):
        append_line(Path(path), {"worker": worker, "i": i, "pad": "x" * (i * 37 % 5000)})


def test_concurrent_appends_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    procs = [multiprocessing.get_context("fork").Process(target=_writer, args=(str(path), w)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    lines = _lines(path)
    assert len(lines) == 1200
    assert {(ln["worker"], ln["i"]) for ln in lines} == {(w, i) for w in range(6) for i in range(200)}


def test_read_results_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"test": "a"}\n{"test": "b"}\n{"test": "c", "outc')
    assert [ln["test"] for ln in read_results(path)] == ["a", "b"]


# ---------------------------------------------------------------------- pytest runs


def test_example_eval_suite_writes_one_line_per_episode(pytester: pytest.Pytester, smol_state: Path) -> None:
    shutil.copytree(EVALS, pytester.path / "evals")
    pytester.path.joinpath("results").mkdir()
    pytester.path.joinpath("results", "r.jsonl").write_text("stale line from an earlier run\n")
    result = pytester.runpytest_subprocess("evals", "-n", "2", "--smol-results=results/r.jsonl",
                                           "-p", "no:randomly")
    result.assert_outcomes(passed=12)
    lines = _lines(pytester.path / "results" / "r.jsonl")  # the stale line is gone: truncated once
    tasks = sorted(p.name for p in (EVALS / "tasks").iterdir())
    expected_ids = {f"evals/test_evals.py::test_agent[{t}-ep{i}]" for t in tasks for i in range(4)}
    assert [ln["test"] for ln in lines if ln["test"] in expected_ids] == [ln["test"] for ln in lines]
    assert {ln["test"] for ln in lines} == expected_ids and len(lines) == 12
    for ln in lines:
        assert set(ln) >= REQUIRED, ln
        assert ln["function"] == "evals/test_evals.py::test_agent"
        assert ln["params"] == {"task": ln["case"]} and ln["case"] in tasks
        assert ln["seed"] == episode_seed(0, ln["episode"]) and ln["episodes"] == 4
        assert ln["outcome"] == ln["cause"] == "passed" and 0 <= ln["reward"] <= 1 and ln["info"]["task"] == ln["case"]
        assert ln["v"] == 2 and ln["artifacts"] is None  # no --smol-artifacts: nothing saved to link
        assert set(ln["durations"]) == {"setup", "call", "teardown", "provision", "destroy"}
        assert ln["durations"]["provision"] > 0 and ln["durations"]["destroy"] >= 0  # destroy: handed off
        assert len(ln["vms"]) == 1 and ln["vms"][0].startswith("smol-")
        assert ln["backend"] in ("namespace", "smol") and ln["baseline_digest"].startswith("sha256:")
        assert ln["worker"] in ("gw0", "gw1")
    assert len({ln["run_id"] for ln in lines}) == 1
    assert len({vm for ln in lines for vm in ln["vms"]}) == 12  # a fresh guest per episode

    # The summary row is the lines, aggregated.
    rewards = [ln["reward"] for ln in lines]
    mean = sum(rewards) / len(rewards)
    se = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1) / len(rewards))
    row = _table_row(result.stdout.str(), "evals/test_evals.py::test_agent")
    assert row == ["3", "12", "12", "1.000", "1.000", "4", f"{mean:.3f}", f"{se:.3f}", f"{min(rewards):.3f}",
                   f"{max(rewards):.3f}", "0"]
    result.stdout.fnmatch_lines(["*smolvm: 12 result line(s) in *r.jsonl"])


def test_episodes_grid_ids_seeds_and_outcomes(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("task", ["t1", "t2"])
        @pytest.mark.smol_episodes(3, seed=5)
        def test_grid(smol_vm, smol_episode, task):
            assert smol_vm.exec("hostname").stdout.strip() == smol_vm.name
            smol_episode.record(smol_episode.index / 2, task=task, seed=smol_episode.seed)
            assert smol_episode.index != 2 or task == "t1"

        @pytest.mark.smol_episodes(n=2)
        def test_skips(smol_episode):
            pytest.skip("not this one")

        def test_plain(smol_vm):
            pass
    """)
    result = pytester.runpytest_subprocess("-n", "2", "--smol-results=r.jsonl", "-p", "no:randomly",
                                           "--strict-markers")
    result.assert_outcomes(passed=6, failed=1, skipped=2)
    lines = {ln["test"].split("::")[1]: ln for ln in _lines(pytester.path / "r.jsonl")}
    assert sorted(lines) == sorted([f"test_grid[{t}-ep{i}]" for t in ("t1", "t2") for i in range(3)]
                                   + ["test_skips[ep0]", "test_skips[ep1]", "test_plain"])
    for t in ("t1", "t2"):
        for i in range(3):
            ln = lines[f"test_grid[{t}-ep{i}]"]
            assert (ln["case"], ln["episode"], ln["seed"]) == (t, i, episode_seed(5, i))
            assert ln["info"] == {"task": t, "seed": episode_seed(5, i)} and ln["reward"] == i / 2
    assert lines["test_grid[t2-ep2]"]["outcome"] == "failed"
    assert lines["test_grid[t2-ep2]"]["message"].startswith("AssertionError: assert")
    assert lines["test_skips[ep1]"]["outcome"] == "skipped" and lines["test_skips[ep1]"]["message"] == "not this one"
    assert lines["test_skips[ep0]"]["vms"] == [] and lines["test_skips[ep0]"]["seed"] == episode_seed(0, 0)
    plain = lines["test_plain"]
    assert (plain["episode"], plain["episodes"], plain["seed"], plain["reward"]) == (None, None, None, None)
    row = _table_row(result.stdout.str(), "test_episodes_grid_ids_seeds_and_outcomes.py::test_grid")
    # pass@1: t1 3/3, t2 2/3 -> 0.833; pass@3: both tasks have a pass -> 1.0; rewards 0, .5, 1 twice.
    assert row == ["2", "6", "5", "0.833", "1.000", "3", "0.500", "0.183", "0.000", "1.000", "0"]
    skips = _table_row(result.stdout.str(), "test_episodes_grid_ids_seeds_and_outcomes.py::test_skips")
    assert skips == ["1", "2", "0", "-", "-", "0", "-", "-", "-", "0"]


def test_collection_is_identical_on_every_worker(pytester: pytest.Pytester, smol_state: Path) -> None:
    # xdist refuses to run when workers collect different ids; seeds must agree as well.
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol_episodes(8, seed=123)
        def test_seed(smol_episode, worker_id):
            smol_episode.record(0.0, worker=worker_id)
    """)
    collected = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "no:randomly")
    ids = [line for line in collected.stdout.lines if "::test_seed[" in line]
    assert ids == [f"test_collection_is_identical_on_every_worker.py::test_seed[ep{i}]" for i in range(8)]
    result = pytester.runpytest_subprocess("-n", "2", "--smol-results=r.jsonl", "-p", "no:randomly")
    result.assert_outcomes(passed=8)
    lines = _lines(pytester.path / "r.jsonl")
    assert {ln["info"]["worker"] for ln in lines} == {"gw0", "gw1"}
    assert sorted((ln["episode"], ln["seed"]) for ln in lines) == [(i, episode_seed(123, i)) for i in range(8)]


def test_killed_worker_leaves_the_other_lines_intact(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import os
        import time

        import pytest

        @pytest.mark.smol_episodes(6)
        def test_episode(smol_vm, smol_episode):
            smol_vm.exec("echo working > /tmp/progress", check=True)
            if smol_episode.index == 3:
                os.kill(os.getpid(), 9)  # the worker dies mid-test, guest and all
            smol_episode.record(1.0)
    """)
    result = pytester.runpytest_subprocess("-n", "2", "--smol-results=r.jsonl", "-p", "no:randomly")
    result.assert_outcomes(passed=5, failed=1)
    lines = _lines(pytester.path / "r.jsonl")
    assert len(lines) == 6
    by_episode = {ln["episode"]: ln for ln in lines}
    assert sorted(by_episode) == list(range(6))
    crashed = by_episode.pop(3)
    assert crashed["outcome"] == "error" and crashed["crashed"] is True and "crashed" in crashed["message"]
    assert crashed["cause"] == "crashed" and crashed["v"] == 2
    [vm] = crashed["vms"]  # the guest the crashed episode had, as every other line names its own
    assert vm.startswith("smol-") and vm not in {v for ln in by_episode.values() for v in ln["vms"]}
    assert all(ln["outcome"] == "passed" and ln["reward"] == 1.0 for ln in by_episode.values())
    row = _table_row(result.stdout.str(), "test_killed_worker_leaves_the_other_lines_intact.py::test_episode")
    assert row[:6] == ["1", "6", "5", "0.833", "1.000", "6"]


def test_quiet_summary_is_one_line_per_test(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol_episodes(2)
        def test_q(smol_episode):
            smol_episode.record(1)
    """)
    result = pytester.runpytest_subprocess("-q", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["test_quiet_summary_is_one_line_per_test.py::test_q: 2 episodes (1 task), "
                                 "2 passed, pass@1 1.000, pass@2 1.000, reward 1.000 ± 0.000"])
    assert "reward (mean ± se)" not in result.stdout.str()



def test_quiet_line_of_one_episode_and_a_crashed_plain_test(pytester: pytest.Pytester, smol_state: Path) -> None:
    # k = 1: pass@1 once, not "pass@1 1.000, pass@1 1.000". A plain test whose worker died has
    # neither episodes nor a reward: its crashed line is in the file, but it gets no summary row.
    pytester.makepyfile(test_q="""
        import os

        import pytest

        @pytest.mark.smol_episodes(1)
        def test_one(smol_episode):
            smol_episode.record(1)

        def test_crash(smol_vm):
            smol_vm.exec("true")
            os.kill(os.getpid(), 9)  # the worker dies mid-test
    """)
    result = pytester.runpytest_subprocess("-q", "-n", "2", "-p", "no:randomly", "--smol-results=r.jsonl")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["test_q.py::test_one: 1 episode (1 task), 1 passed, pass@1 1.000, reward 1.000 ± -"])
    out = result.stdout.str()
    assert "pass@1 1.000, pass@1" not in out
    assert "test_q.py::test_crash:" not in out and "scored 0" not in out
    crashed = {ln["test"]: ln for ln in _lines(pytester.path / "r.jsonl")}["test_q.py::test_crash"]
    assert crashed["crashed"] is True and crashed["outcome"] == "error" and crashed["episode"] is None


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_rerun_attempts_are_marked_and_not_counted_as_episodes(pytester: pytest.Pytester, smol_state: Path,
                                                               workers: list[str]) -> None:
    # smol_episodes(2) is 2 episodes however often pytest-rerunfailures runs each: an attempt it
    # runs again keeps its line (its own fresh guest, its failure), marked "rerun", counted nowhere.
    pytest.importorskip("pytest_rerunfailures", reason="needs pytest-rerunfailures (pip install "
                        "pytest-rerunfailures; noxfile.py's newest cell installs it)")
    pytester.makepyfile(test_rr="""
        import pytest

        SEEN = set()

        @pytest.mark.smol_episodes(2)
        def test_ep(smol_vm, smol_episode):
            first = smol_episode.index not in SEEN
            SEEN.add(smol_episode.index)
            smol_episode.record(0.0 if first else 1.0)
            assert not first
    """)
    result = pytester.runpytest_subprocess("-p", "rerunfailures", "--reruns", "1", "-q", "-p", "no:randomly",
                                           "--smol-results=r.jsonl", *workers)
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("rerun"), outcomes.get("failed")) == (2, 2, None), outcomes
    path = pytester.path / "r.jsonl"
    lines = _lines(path)
    assert sorted((ln["episode"], ln["outcome"], ln["reward"]) for ln in lines) == [
        (0, "passed", 1.0), (0, "rerun", 0.0), (1, "passed", 1.0), (1, "rerun", 0.0)]
    reruns = [ln for ln in lines if ln["outcome"] == "rerun"]
    assert all(ln["cause"] == "failed" and ln["message"].startswith("assert not") for ln in reruns)
    assert len({vm for ln in lines for vm in ln["vms"]}) == 4  # a fresh guest per attempt
    result.stdout.fnmatch_lines([
        "test_rr.py::test_ep: 2 episodes (1 task), 2 passed, pass@1 1.000, pass@2 1.000, reward 1.000 ± 0.000",
        "smolvm: 4 result line(s) in *r.jsonl (2 of them rerun attempts, not counted as episodes)"])
    done = subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", "results", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"{path}: 2 episodes (2 rerun attempts not counted)" in done.stdout
    assert _table_row(done.stdout, "test_rr.py::test_ep") == ["1", "2", "2", "1.000", "1.000", "2", "1.000",
                                                               "0.000", "1.000", "1.000", "0"]
    assert "outcomes: passed 2 (2 rerun attempts not counted)" in done.stdout

@pytest.mark.parametrize(("marker", "message"), [
    ("smol_episodes(0)", "test_bad.py::test_x: @pytest.mark.smol_episodes(n=0): n must be a positive integer"),
    ("smol_episodes('3')", "*@pytest.mark.smol_episodes(n='3'): n must be a positive integer"),
    ("smol_episodes(True)", "*@pytest.mark.smol_episodes(n=True): n must be a positive integer"),
    ("smol_episodes(2, seed=1.5)", "*@pytest.mark.smol_episodes(seed=1.5): seed must be an integer"),
    ("smol_episodes()", "*@pytest.mark.smol_episodes needs the number of episodes: smol_episodes(n, seed=0)"),
    ("smol_episodes(2, 3, 4)", "*@pytest.mark.smol_episodes takes (n, seed=0), got args=(2, 3, 4)*"),
])
def test_bad_marker_is_a_one_line_collection_error(pytester: pytest.Pytester, smol_state: Path, marker: str,
                                                   message: str) -> None:
    pytester.makepyfile(test_bad=f"""
        import pytest

        @pytest.mark.{marker}
        def test_x():
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([message])
    assert "Traceback" not in result.stdout.str()


def test_bad_reward_fails_the_test_with_a_clear_message(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("bad", ["'1.0'", "float('nan')", "float('inf')", "True", "None", "10**400"])
        def test_reward(smol_episode, bad):
            smol_episode.record(eval(bad))

        def test_info(smol_episode):
            smol_episode.record(1.0, blob=object())

        def test_last_call_wins(smol_episode):
            smol_episode.record(0.5, a=1)
            smol_episode.record(0.25, b=2)
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-results=r.jsonl")
    result.assert_outcomes(failed=7, passed=1)
    result.stdout.fnmatch_lines([
        "*TypeError: smol_episode.record(reward='1.0'): expected a finite number, got str",
        "*ValueError: smol_episode.record(reward=nan): expected a finite number",
        "*ValueError: smol_episode.record(reward=inf): expected a finite number",
        "*TypeError: smol_episode.record(reward=True): expected a finite number, got bool",
        "*TypeError: smol_episode.record(reward=None): expected a finite number, got NoneType",
        "*ValueError: smol_episode.record(reward=1000*000): expected a finite number",  # was float()'s OverflowError
        "*TypeError: smol_episode.record(**info): info must be JSON-serialisable*",
    ])
    last = [ln for ln in _lines(pytester.path / "r.jsonl") if ln["test"].endswith("test_last_call_wins")]
    assert (last[0]["reward"], last[0]["info"]) == (0.25, {"b": 2})


def test_unwritable_results_path_is_a_usage_error(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("def test_x(): pass\n")
    pytester.path.joinpath("blocker").write_text("a file, not a dir")
    result = pytester.runpytest_subprocess("--smol-results=blocker/r.jsonl")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert re.search(r"--smol-results=\S*blocker/r.jsonl: cannot create it", result.stderr.str())


RETAINING_SUITE = """
import gc, weakref
import pytest

class Local:
    pass

REFS = []

@pytest.mark.smol_episodes(4)
{kind}def test_fails(smol_vm, smol_episode):
    local = Local()  # stands in for what an episode holds: a model's outputs, a trajectory
    REFS.append(weakref.ref(local))
    assert {exec_false}.exit_code == 0

def test_zz_after(smol_vm):
    gc.collect()
    alive = sum(ref() is not None for ref in REFS)
    # pytest keeps the last failure for post-mortem debugging (sys.last_value): one may live
    assert alive <= 1, f"{{alive}} of {{len(REFS)}} failed episodes' locals outlived their reports"
"""


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_failed_episodes_locals_do_not_outlive_its_report(pytester: pytest.Pytester, smol_state: Path,
                                                           kind: str) -> None:
    # An RL run fails episodes by the thousand: none may keep its frames for the rest of the session.
    pytester.makepyfile(RETAINING_SUITE.format(
        kind="async " if kind == "async" else "",
        exec_false='(await smol_vm.aio.exec("false"))' if kind == "async" else 'smol_vm.exec("false")'))
    extra = ["--smol-concurrency=4"] if kind == "async" else []
    # pytest-rerunfailures, where installed, keeps every failure's exception on its item itself
    result = pytester.runpytest_subprocess("--smol-backend=namespace", "-p", "no:randomly", "-p", "no:rerunfailures",
                                           *extra)
    result.assert_outcomes(failed=4, passed=1)
