"""One run's figures as an HTML fragment, overall and per task: pass@k with its band, mean reward
with its interval, the reward and duration distributions and the outcome breakdown, each
non-passing episode linked to its saved guest log. Shared by the ``results --html`` report and
the pytest-html section, so both show the same thing.

Every episode is scored by the one convention (``evals/reward.py``) and read in canonical order,
as the terminal views do: the header's mean, the per-task chart and the comparison agree with
the summary table, and every attempted episode is a mark in its group's plots."""

from __future__ import annotations

import os
import urllib.parse
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_smolvm.evals.results import svg
from pytest_smolvm.evals.results.episode_plots import Mark, distribution, ecdf
from pytest_smolvm.evals.results.load import CAUSES, cause
from pytest_smolvm.evals.results.stats import BOOTSTRAP_RESAMPLES, bootstrap, pass_at_k_curve
from pytest_smolvm.evals.results.svg import Span, esc
from pytest_smolvm.evals.reward import NOT_ATTEMPTED, attempted, canonical, episode_lines, final, score, scores, task_of

CONVENTION = ("An episode's reward is the one it recorded; an episode that recorded none scores 1 if it "
              "passed and 0 if it failed, errored, timed out or crashed (hollow dots); skipped episodes "
              "are not scored. The terminal table, these headers, every chart and the comparison use it.")
METHOD = (f"{CONVENTION} Intervals are 95% percentile bootstrap intervals over episodes ({BOOTSTRAP_RESAMPLES} "
          "resamples of the episodes in a canonical order, fixed seed: the same file gives the same figures "
          "whatever the order of its lines); the pass@k band resamples each task's episodes. pass@k is the "
          "unbiased estimator (Chen et al. 2021), averaged over tasks.")
HOLLOW = "no reward recorded: pass 1, fail 0"


def eval_lines(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The episodes, in canonical order (``reward.episode_lines``); every line but rerun attempts
    if none is one."""
    return canonical(episode_lines(lines) or final(lines))


def duration(line: dict[str, Any]) -> float | None:
    """Setup + call + teardown seconds, or None for a line without them (a crashed worker's)."""
    durations = line.get("durations") or {}
    phases = [durations.get(p) for p in ("setup", "call", "teardown")]
    values = [float(v) for v in phases if isinstance(v, (int, float))]
    return sum(values) if values else None


def log_href(line: dict[str, Any], name: str, relative_to: Path | None) -> str | None:
    """A link to ``name`` in the episode's ``--smol-artifacts`` directory, if the run kept one.

    Percent-encoded, so nothing in the path can become a URL scheme (``javascript:``)."""
    where = line.get("artifacts")
    if not isinstance(where, str) or not where:
        return None
    target = os.path.join(where, name)
    if relative_to is not None and os.path.isabs(target):
        try:
            return urllib.parse.quote(os.path.relpath(target, relative_to))
        except ValueError:
            pass
    return ("file://" if os.path.isabs(target) else "") + urllib.parse.quote(target)


def log_links(line: dict[str, Any], relative_to: Path | None) -> str:
    """The episode's transcript, guest log and its whole artifacts folder (files/, notes.txt)."""
    links = [f'<a href="{esc(href)}">{label}</a>' for name, label in
             (("transcript.txt", "transcript"), ("guest-logs.txt", "guest log"), ("", "folder"))
             if (href := log_href(line, name, relative_to)) is not None]
    return " ".join(links)


def counts_by_task(lines: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    tasks: dict[str, list[dict[str, Any]]] = {}
    for ln in lines:
        if ln.get("outcome") not in NOT_ATTEMPTED:
            tasks.setdefault(task_of(ln), []).append(ln)
    return [(len(ls), sum(ln.get("outcome") == "passed" for ln in ls)) for ls in tasks.values()]


def group(title: str, lines: Sequence[dict[str, Any]], relative_to: Path | None, *, level: int = 3,
          extra: Sequence[str] = ()) -> str:
    """The numbers and plots of ``lines`` (one task, or a whole run)."""
    lines = canonical(lines)
    scored = scores(lines)
    counts = Counter(cause(ln) for ln in lines)
    curve = pass_at_k_curve(counts_by_task(lines))
    mean = bootstrap(scored.values)
    facts = [f"{len(lines)} episodes", f"{counts['passed']} passed"]
    if mean is not None:
        zeroed = f" ({esc(scored.note())})" if scored.zeroed else ""
        facts.append(f'mean reward <b class="mean">{mean.estimate:.3f}</b> [{mean.low:.3f}, {mean.high:.3f}]'
                     f"{zeroed}")
    if curve:
        facts.append(f"pass@1 {curve[0].estimate:.3f} [{curve[0].low:.3f}, {curve[0].high:.3f}]")
        if len(curve) > 1:
            last = curve[-1]
            facts.append(f"pass@{len(curve)} {last.estimate:.3f} [{last.low:.3f}, {last.high:.3f}]")
    def mark(value: float, ln: dict[str, Any], hollow: bool) -> Mark:
        return Mark(value, cause(ln), str(ln.get("test", "")), hollow, log_href(ln, "transcript.txt", relative_to))

    rewards = [mark(s, ln, ln.get("reward") is None) for ln in lines if (s := score(ln)) is not None]
    attempts = [ln for ln in lines if attempted(ln)]  # a skip's seconds say nothing of the agent
    durations = [mark(d, ln, False) for ln in attempts if (d := duration(ln)) is not None]
    plots = [
        svg.curve([Span(p.estimate, p.low, p.high) for p in curve], f"{title}: pass@k", "k", "pass@k"),
        distribution(rewards, f"{title}: reward", "reward", HOLLOW),
        ecdf(durations, f"{title}: duration", "seconds (setup + call + teardown)", len(attempts) - len(durations)),
        *extra,
        svg.outcome_bar([(c, counts[c]) for c in CAUSES], f"{title}: outcomes"),
    ]
    return (f'<section class="group"><h{level}>{esc(title)}</h{level}><p class="facts">{" · ".join(facts)}</p>'
            f'<div class="plots">{"".join(plots)}</div>{_not_passed(lines, relative_to)}</section>')


def _not_passed(lines: Sequence[dict[str, Any]], relative_to: Path | None) -> str:
    """Every episode that did not pass, by cause, each with a link to its guest log if kept."""
    by_cause: dict[str, list[dict[str, Any]]] = {}
    for ln in lines:
        if cause(ln) not in ("passed", "skipped"):
            by_cause.setdefault(cause(ln), []).append(ln)
    if not by_cause:
        return ""
    items = []
    for c in CAUSES:
        for ln in by_cause.get(c, []):
            links = log_links(ln, relative_to)
            message = str(ln.get("message") or "")
            items.append(f'<li><span class="cause cause-{esc(c)}">{esc(c)}</span> {esc(ln.get("test", ""))}'
                         f'{" " + links if links else ""}<br><code>{esc(message[:300])}</code></li>')
    return f'<details class="not-passed"><summary>not passed: {len(items)}</summary><ul>{"".join(items)}</ul></details>'


def run_figures(lines: Sequence[dict[str, Any]], relative_to: Path | None) -> str:
    """A run overall, then each of its tasks."""
    episodes = eval_lines(lines)
    tasks: dict[str, list[dict[str, Any]]] = {}
    for ln in episodes:
        tasks.setdefault(task_of(ln), []).append(ln)
    means = []
    for task, ls in sorted(tasks.items()):
        if (mean := bootstrap(scores(ls).values)) is not None:
            means.append((task, Span(mean.estimate, mean.low, mean.high), None))
    extra = [svg.intervals(means, "mean reward per task", "mean reward (a failure without one scores 0)")]
    parts = [group("all episodes", episodes, relative_to, extra=extra if len(means) > 1 else ())]
    if len(tasks) > 1:
        parts += [group(task, ls, relative_to, level=4) for task, ls in sorted(tasks.items())]
    return "".join(parts)
