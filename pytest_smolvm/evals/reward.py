"""The one reward convention every view of eval results uses, and the one order they read lines in.

The end-of-run summary table, ``pytest-smolvm results`` in the terminal, the HTML report's
headers, every chart and the run-to-run comparison all score an episode with ``score`` and read
lines in ``canonical`` order, so they cannot disagree about a mean, and a results file whose
lines arrive in another order (xdist workers finish when they finish) gives the same figures.

The convention (docs/evals.md, "One reward convention"):

- an episode that recorded a reward scores that reward, whatever its outcome;
- an attempted episode that recorded none scores 1 if it passed and 0 if it did not (failed,
  errored, timed out, ran out of memory, crashed): a crash is not left out of the mean, which
  would flatter the task that crashes most;
- skipped and xfailed episodes are not attempts: no score, as pass@k leaves them out.

A rerun attempt (pytest-rerunfailures ran the test again: its line's outcome is ``rerun``) is not
an episode at all: the test's last attempt is. ``final`` leaves rerun attempts out.

Wherever a mean is shown, the count of episodes scored 0 for want of a reward is shown beside it.
Light on purpose: the summary imports it at pytest start-up.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

NOT_ATTEMPTED = ("skipped", "xfailed")
PASSED = ("passed", "xpassed")
RERUN = "rerun"  # pytest-rerunfailures' outcome of an attempt it ran again


def is_rerun(line: dict[str, Any]) -> bool:
    """An attempt that pytest-rerunfailures ran again: not an episode, the last attempt is."""
    return line.get("outcome") == RERUN


def final(lines: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``lines`` without rerun attempts: one line per test, its last attempt's."""
    return [ln for ln in lines if not is_rerun(ln)]


def is_episode(line: dict[str, Any]) -> bool:
    """An eval line: an episode of a ``smol_episodes`` test (a crashed one too: its id names the
    episode) or a recorded reward. A rerun attempt is none."""
    if is_rerun(line):
        return False
    return (line.get("episodes") is not None or line.get("reward") is not None
            or (bool(line.get("crashed")) and line.get("episode") is not None))


def episode_lines(lines: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lines of test functions that have episodes or recorded rewards: ``is_episode`` lines,
    and the crashed lines of those functions (the controller's line of a test whose worker died
    knows only its id: an id without an episode part may still be one of the function's tasks).
    A crashed test of any other function has no episodes and no reward: it is no eval line."""
    kept = final(lines)
    functions = {line.get("function") for line in kept if is_episode(line)}
    return [line for line in kept if is_episode(line) or (line.get("crashed") and line.get("function") in functions)]


def attempted(line: dict[str, Any]) -> bool:
    return line.get("outcome") not in NOT_ATTEMPTED


def score(line: dict[str, Any]) -> float | None:
    """The episode's score under the convention above; None if it was not attempted."""
    if not attempted(line):
        return None
    if line.get("reward") is not None:
        return float(line["reward"])
    return 1.0 if line.get("outcome") in PASSED else 0.0


def defaulted(line: dict[str, Any]) -> bool:
    """Attempted, did not pass, recorded no reward: scored 0 by the convention."""
    return attempted(line) and line.get("reward") is None and line.get("outcome") not in PASSED


@dataclass(frozen=True)
class Scores:
    values: list[float]  # one per attempted episode, in canonical order
    zeroed: int  # of them: did not pass and recorded no reward, so scored 0

    def note(self) -> str:
        """What goes beside the mean: how many of its episodes were scored 0 for want of a reward."""
        if not self.zeroed:
            return ""
        return f"{self.zeroed} of {len(self.values)} failed without a reward, scored 0"


def scores(lines: Iterable[dict[str, Any]]) -> Scores:
    ordered = canonical(lines)
    return Scores([s for ln in ordered if (s := score(ln)) is not None], sum(defaulted(ln) for ln in ordered))


def _number(value: object) -> tuple[int, float]:
    """Numbers before anything else, so episodes 2 and 10 sort as numbers."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value))
    return (1, 0.0)


def canonical_key(line: dict[str, Any]) -> tuple[Any, ...]:
    """Function, task, episode, seed, test id, then the whole line: a total order on lines."""
    return (str(line.get("function", "")), str(line.get("case") or ""), _number(line.get("episode")),
            _number(line.get("seed")), str(line.get("test", "")), json.dumps(line, sort_keys=True, default=str))


def canonical(lines: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``lines`` in the one order every view reads them in (the file's order is the workers')."""
    return sorted(lines, key=canonical_key)


def task_of(line: dict[str, Any]) -> str:
    case = line.get("case") or ""
    return f"{line.get('function', '')}[{case}]" if case else str(line.get("function", ""))


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
