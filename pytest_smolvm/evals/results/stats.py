"""Statistics over result lines: pass@k curves, bootstrap intervals and paired run comparison.

Intervals are percentile bootstrap over episodes with a fixed seed, resampling the values in a
canonical (sorted) order, so the same file always gives the same figures whatever the order of its
lines; the per-task pass@k estimator is the unbiased one in ``evals/summary.py``. Episodes are
scored by the one convention in ``evals/reward.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_smolvm.evals.reward import canonical, final, score, task_of
from pytest_smolvm.evals.summary import pass_at_k

BOOTSTRAP_SEED = 29
BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0.0 or self.high < 0.0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def bootstrap(values: Sequence[float], statistic: Callable[[Sequence[float]], float] = _mean,
              level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
              seed: int = BOOTSTRAP_SEED) -> Interval | None:
    """Percentile bootstrap interval of ``statistic`` over ``values``; None when there are none.

    The values are sorted before resampling: the fixed seed then draws the same multiset's
    resamples whatever order the values came in (a results file's order is the workers')."""
    if not values:
        return None
    values = sorted(values)
    rng = random.Random(seed)
    n = len(values)
    draws = sorted(statistic([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    low = draws[int(tail * (resamples - 1))]
    high = draws[round((1.0 - tail) * (resamples - 1))]
    return Interval(statistic(values), low, high)


def pass_at_k_curve(counts: Sequence[tuple[int, int]], level: float = 0.95,
                    resamples: int = 500, seed: int = BOOTSTRAP_SEED) -> list[Interval]:
    """pass@k for k = 1 … min n over tasks given ``(n, c)`` per task, each with a band from a
    bootstrap over each task's episodes (resampling its passes and fails)."""
    if not counts:
        return []
    counts = sorted(counts)  # the replicas' draws must not depend on the order tasks came in
    kmax = min(n for n, _ in counts)
    rng = random.Random(seed)
    replicas: list[list[tuple[int, int]]] = []
    for _ in range(resamples):
        replicas.append([(n, sum(rng.random() < c / n for _ in range(n))) for n, c in counts])
    curve = []
    for k in range(1, kmax + 1):
        estimate = _mean([pass_at_k(n, c, k) for n, c in counts])
        draws = sorted(_mean([pass_at_k(n, c, k) for n, c in rep]) for rep in replicas)
        tail = (1.0 - level) / 2.0
        curve.append(Interval(estimate, draws[int(tail * (resamples - 1))],
                              draws[round((1.0 - tail) * (resamples - 1))]))
    return curve


@dataclass(frozen=True)
class TaskDifference:
    task: str
    pairs: int
    difference: Interval | None  # other run's reward minus the base run's, paired by seed

    @property
    def flagged(self) -> bool:
        return self.direction is not None

    @property
    def direction(self) -> str | None:
        """"better" (the interval is above zero: higher reward), "worse" (below), None (no evidence)."""
        if self.difference is None or not self.difference.excludes_zero():
            return None
        return "better" if self.difference.low > 0.0 else "worse"


def compare(base: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]]) -> list[TaskDifference]:
    """Per-task score differences (``other`` - ``base``, each episode scored by ``reward.score``),
    episodes paired by (task, seed), falling back to episode index when seeds are absent. Lines
    are read in canonical order, so a (task, seed) written twice pairs the same one every time;
    a rerun attempt (pytest-rerunfailures) is no episode: its test's last attempt is paired."""
    def keyed(lines: Sequence[dict[str, Any]]) -> dict[tuple[str, Any], float]:
        return {(task_of(ln), ln.get("seed") if ln.get("seed") is not None else ("ep", ln.get("episode"))): s
                for ln in canonical(final(lines)) if (s := score(ln)) is not None}
    a, b = keyed(base), keyed(other)
    tasks: dict[str, list[float]] = {}
    for key in a.keys() & b.keys():
        tasks.setdefault(key[0], []).append(b[key] - a[key])
    return [TaskDifference(task, len(diffs), bootstrap(sorted(diffs))) for task, diffs in sorted(tasks.items())]


def baseline_digests(lines: Sequence[dict[str, Any]]) -> set[str]:
    """The baseline digests a run's episodes booted from; runs that differ here are not like for like."""
    return {str(ln["baseline_digest"]) for ln in lines if ln.get("baseline_digest")}
