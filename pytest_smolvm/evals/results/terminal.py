"""``pytest-smolvm results`` in the terminal: the eval summary table with bootstrap intervals,
the outcome breakdown, and run-to-run comparison. Every figure scores episodes by the one
convention (``evals/reward.py``) and reads lines in canonical order, as the HTML report does."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_smolvm.evals.results.load import CAUSES, cause
from pytest_smolvm.evals.results.stats import baseline_digests, bootstrap, compare
from pytest_smolvm.evals.reward import episode_lines, final, scores
from pytest_smolvm.evals.summary import SummaryRow, format_table, summarize

DIRECTION_MARK = {"better": "  better", "worse": "  WORSE"}


def _row_lines(lines: Sequence[dict[str, Any]], row: SummaryRow) -> list[dict[str, Any]]:
    """The lines a summary row is computed from."""
    return [ln for ln in episode_lines(lines) if ln["function"] == row.function
            and (row.task is None or (ln.get("case") or "") == row.task)]


def _reruns(lines: Sequence[dict[str, Any]]) -> str:
    reruns = len(lines) - len(final(lines))
    return f" ({reruns} rerun attempt{'' if reruns == 1 else 's'} not counted)" if reruns else ""


def run_summary(path: Path, lines: Sequence[dict[str, Any]]) -> list[str]:
    return [f"{path}: {len(final(lines))} episodes{_reruns(lines)}", *format_table(summarize(list(lines))),
            *details(lines)]


def details(lines: Sequence[dict[str, Any]]) -> list[str]:
    """Under the summary table: each row's mean reward with its interval, and the outcome breakdown."""
    out, intervals = [], []
    for row in summarize(list(lines)):
        scored = scores(_row_lines(lines, row))
        interval = bootstrap(scored.values)
        if interval is not None:
            note = f" ({scored.note()})" if scored.zeroed else ""
            intervals.append(f"  {row.label.strip()}: reward {interval.estimate:.3f} "
                             f"[{interval.low:.3f}, {interval.high:.3f}]{note}")
    if intervals:
        out += ["reward mean (a failure without a reward scores 0), 95% bootstrap interval over episodes:",
                *intervals]
    counts = Counter(cause(ln) for ln in final(lines))  # a rerun attempt is not an outcome: its last attempt is
    out.append("outcomes: " + ", ".join(f"{c} {counts[c]}" for c in CAUSES if counts[c]) + _reruns(lines))
    return out


def comparison(base_path: Path, base: Sequence[dict[str, Any]],
               other_path: Path, other: Sequence[dict[str, Any]]) -> list[str]:
    out = [f"{other_path} vs {base_path}: reward difference per task, paired by seed (95% bootstrap)"]
    a, b = baseline_digests(base), baseline_digests(other)
    if a != b:
        out.append(f"  note: different baseline digests ({', '.join(sorted(a)) or 'none'} vs "
                   f"{', '.join(sorted(b)) or 'none'}); not like for like")
    diffs = compare(base, other)
    if not diffs:
        out.append("  no episodes in common (same task and seed)")
    for d in diffs:
        if d.difference is None:
            continue
        mark = DIRECTION_MARK.get(d.direction or "", "")
        out.append(f"  {d.task}: {d.difference.estimate:+.3f} [{d.difference.low:+.3f}, "
                   f"{d.difference.high:+.3f}] over {d.pairs} pairs{mark}")
    if any(d.flagged for d in diffs):
        out.append("  better / WORSE: the interval is above / below zero; unmarked: no evidence of a change")
    return out
