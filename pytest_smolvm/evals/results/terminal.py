"""``pytest-smolvm results`` in the terminal: the eval summary table with bootstrap intervals,
the outcome breakdown, and run-to-run comparison."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_smolvm.evals.results.load import CAUSES, cause
from pytest_smolvm.evals.results.stats import baseline_digests, bootstrap, compare
from pytest_smolvm.evals.summary import format_table, summarize


def _rewards(lines: Sequence[dict[str, Any]], function: str, task: str | None) -> list[float]:
    return [float(ln["reward"]) for ln in lines if ln.get("reward") is not None and ln["function"] == function
            and (task is None or (ln.get("case") or "") == task)]


def run_summary(path: Path, lines: Sequence[dict[str, Any]]) -> list[str]:
    return [f"{path}: {len(lines)} episodes", *format_table(summarize(list(lines))), *details(lines)]


def details(lines: Sequence[dict[str, Any]]) -> list[str]:
    """Under the summary table: each row's mean reward with its interval, and the outcome breakdown."""
    out, intervals = [], []
    for row in summarize(list(lines)):
        interval = bootstrap(_rewards(lines, row.function, row.task))
        if interval is not None:
            intervals.append(f"  {row.label.strip()}: reward {interval.estimate:.3f} "
                             f"[{interval.low:.3f}, {interval.high:.3f}]")
    if intervals:
        out += ["reward mean, 95% bootstrap interval over episodes:", *intervals]
    counts = Counter(cause(ln) for ln in lines)
    out.append("outcomes: " + ", ".join(f"{c} {counts[c]}" for c in CAUSES if counts[c]))
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
        flag = "  *" if d.flagged else ""
        out.append(f"  {d.task}: {d.difference.estimate:+.3f} [{d.difference.low:+.3f}, "
                   f"{d.difference.high:+.3f}] over {d.pairs} pairs{flag}")
    if any(d.flagged for d in diffs):
        out.append("  * the interval excludes zero")
    return out
