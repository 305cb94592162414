"""The ``smolvm episodes`` summary: result lines aggregated per test function, then per task.

A task is one (function, case) pair: the function's other parametrize values (``sort`` in
``test_agent[sort-ep3]``). A function with several tasks gets a row of its own and, under it,
a row per task, since a per-task pass rate is what a researcher reads first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from math import comb
from typing import Any

from pytest_smolvm.evals.reward import canonical, episode_lines, scores


@dataclass(frozen=True)
class SummaryRow:
    function: str
    task: str | None  # None: the function's own row; else one of its tasks ("" when unparametrized)
    tasks: int
    episodes: int
    passed: int
    pass_at_1: float | None
    pass_at_k: float | None
    k: int
    reward_mean: float | None
    reward_se: float | None
    reward_min: float | None
    reward_max: float | None
    zeroed: int  # episodes that failed without a reward, scored 0 (evals/reward.py)

    @property
    def label(self) -> str:
        return self.function if self.task is None else f"  [{self.task}]"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) for one task: ``n`` attempts, ``c`` passed."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(lines: list[dict[str, Any]]) -> list[SummaryRow]:
    """A row per test function that has episodes or recorded rewards, each followed by a row per
    task when it has more than one. Rerun attempts (pytest-rerunfailures) are no episodes, and a
    crashed test is one only of such a function (``reward.episode_lines``).

    Skipped and xfailed episodes are not attempts and are left out of pass@1/pass@k; errors
    count as fails. pass@1 and pass@k are the unbiased estimator averaged over tasks, with k the
    smallest number of attempts of any task (the marker's n when every episode ran). With k = n,
    pass@k is the fraction of tasks with at least one passing episode. The reward columns are
    over every attempted episode's score (``evals/reward.py``: a failure without a reward scores 0).
    """
    functions: dict[str, list[dict[str, Any]]] = {}
    for line in canonical(episode_lines(lines)):  # sorted: the same rows whatever order the workers wrote
        functions.setdefault(line["function"], []).append(line)
    rows = []
    for function, group in functions.items():
        tasks: dict[str, list[dict[str, Any]]] = {}
        for line in group:
            tasks.setdefault(line.get("case", ""), []).append(line)
        rows.append(_row(function, None, tasks))
        if len(tasks) > 1:
            rows += [_row(function, case, {case: ls}) for case, ls in tasks.items()]
    return rows


def _row(function: str, task: str | None, tasks: dict[str, list[dict[str, Any]]]) -> SummaryRow:
    group = [line for ls in tasks.values() for line in ls]
    attempts = {case: [ln for ln in ls if ln["outcome"] not in ("skipped", "xfailed")] for case, ls in tasks.items()}
    attempted = {case: ls for case, ls in attempts.items() if ls}
    k = min((len(ls) for ls in attempted.values()), default=0)
    at1 = atk = None
    if attempted:
        counts = [(len(ls), sum(ln["outcome"] == "passed" for ln in ls)) for ls in attempted.values()]
        at1 = sum(pass_at_k(n, c, 1) for n, c in counts) / len(counts)
        atk = sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
    scored = scores(group)
    rewards = scored.values
    mean = se = low = high = None
    if rewards:
        mean = sum(rewards) / len(rewards)
        if len(rewards) > 1:
            variance = sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)
            se = math.sqrt(variance / len(rewards))
        low, high = min(rewards), max(rewards)
    return SummaryRow(function, task, len(tasks), len(group), sum(ln["outcome"] == "passed" for ln in group),
                      at1, atk, k, mean, se, low, high, scored.zeroed)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _reward(row: SummaryRow) -> str:
    if row.reward_mean is None:
        return "-"
    return f"{row.reward_mean:.3f} ± {_num(row.reward_se)}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def format_table(rows: Sequence[SummaryRow]) -> list[str]:
    header = ["test", "tasks", "episodes", "passed", "pass@1", "pass@k", "k", "reward (mean ± se)", "min", "max",
              "fails→0"]
    body = [[r.label, str(r.tasks), str(r.episodes), str(r.passed), _num(r.pass_at_1), _num(r.pass_at_k),
             str(r.k), _reward(r), _num(r.reward_min), _num(r.reward_max), str(r.zeroed)] for r in rows]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return [fmt(header), *(fmt(row) for row in body)]


def format_compact(rows: Sequence[SummaryRow]) -> list[str]:
    """One line per row; pass@k only where k > 1 (pass@1 is shown already; k = 0: no attempt)."""
    return [f"{r.label.strip() if r.task is None else r.label}: {_count(r.episodes, 'episode')}"
            + (f" ({_count(r.tasks, 'task')})" if r.task is None else "")
            + f", {r.passed} passed, pass@1 {_num(r.pass_at_1)}"
            + (f", pass@{r.k} {_num(r.pass_at_k)}" if r.k > 1 else "")
            + f", reward {_reward(r)}"
            + (f" ({r.zeroed} failed without a reward, scored 0)" if r.zeroed else "")
            for r in rows]
