"""The per-episode plots, as inline SVG: every episode of a group is one mark, coloured by its
cause, with a key under the plot saying what colour and shape mean.

- ``strip``: scores where episodes are few, one row per cause (the vertical axis is the cause,
  not jitter), equal scores dodged apart so every one stays visible; a hollow dot is an episode
  that recorded no reward and was scored by the convention (``evals/reward.py``).
- ``histogram``: where episodes are many, the same scores in bins, stacked by cause.
- ``ecdf``: durations as an empirical distribution function (the fraction of episodes that took
  at most x seconds), each episode a dot on the step.

A mark may carry a link (the episode's transcript when the run kept one); ``href`` values come
from ``figures.log_href``, which percent-encodes them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pytest_smolvm.evals.results.load import CAUSES
from pytest_smolvm.evals.results.svg import (
    _BOTTOM,
    _TOP,
    COLOURS,
    HEIGHT,
    INK,
    WIDTH,
    _fmt,
    _Frame,
    _svg,
    _ticks,
    empty,
    esc,
    legend,
)

STRIP_LIMIT = 30  # below: a dot per episode; from here: a histogram
DODGE = (0.0, -5.0, 5.0, -9.0, 9.0, -2.5, 2.5, -7.0, 7.0)  # pixels off a row's centre, for equal values


@dataclass(frozen=True)
class Mark:
    value: float
    cause: str
    label: str  # the tooltip: the episode's test id
    hollow: bool = False  # no reward recorded: scored 1 for a pass, 0 otherwise
    href: str | None = None


def _dot(x: float, y: float, mark: Mark, shown: str) -> str:
    colour = COLOURS.get(mark.cause, INK)
    fill = f'fill="#fff" stroke="{colour}" stroke-width="1.6"' if mark.hollow else f'fill="{colour}" fill-opacity="0.8"'
    dot = (f'<circle class="mark episode" data-cause="{esc(mark.cause)}" cx="{x:.1f}" cy="{y:.1f}" r="4" {fill}>'
           f"<title>{esc(mark.label)}: {esc(shown)} ({esc(mark.cause)})</title></circle>")
    return f'<a href="{esc(mark.href)}">{dot}</a>' if mark.href else dot


def _cause_keys(marks: Sequence[Mark], hollow_text: str | None, shape: str = "dot") -> list[tuple[str, str, str]]:
    counts = Counter(m.cause for m in marks)
    keys = [(shape, COLOURS.get(c, INK), f"{c} {counts[c]}") for c in CAUSES if counts[c]]
    if hollow_text and any(m.hollow for m in marks):
        keys.append(("ring", "#555", hollow_text))
    return keys


def strip(marks: Sequence[Mark], title: str, xlabel: str, hollow_text: str) -> str:
    """A row per cause present; within it, a dot per episode at its value."""
    if not marks:
        return empty(title)
    rows = [c for c in CAUSES if any(m.cause == c for m in marks)]
    row_height = 26
    left = 62
    height = _TOP + _BOTTOM + row_height * len(rows)
    low, high = min(m.value for m in marks), max(m.value for m in marks)
    pad = (high - low) * 0.05 or 0.5
    frame = _Frame((low - pad, high + pad), (0, len(rows)), WIDTH, height, left)
    body = frame.axes(xlabel, "", _ticks(frame.x0, frame.x1), [])
    placed: dict[str, list[float]] = {c: [] for c in rows}
    for mark in marks:
        r = rows.index(mark.cause)
        x = frame.px(mark.value)
        near = sum(abs(x - other) < 7 for other in placed[mark.cause])  # dodge equal values apart
        placed[mark.cause].append(x)
        offset = DODGE[near % len(DODGE)]
        body.append(_dot(x, _TOP + row_height * (r + 0.5) + offset, mark, _fmt(mark.value)))
    for r, c in enumerate(rows):
        body.append(f'<text x="{left - 6}" y="{_TOP + row_height * (r + 0.5) + 4:.1f}" font-size="11" '
                    f'text-anchor="end" fill="{COLOURS.get(c, INK)}">{esc(c)}</text>')
    keys, used = legend(_cause_keys(marks, hollow_text), height, WIDTH)
    return _svg("strip", title, body + keys, WIDTH, height + used)


def histogram(marks: Sequence[Mark], title: str, xlabel: str, hollow_text: str, bins: int = 0) -> str:
    """Counts of the marks' values in equal bins (about √n of them, 5 to 20), stacked by cause."""
    if not marks:
        return empty(title)
    values = [m.value for m in marks]
    low, high = min(values), max(values)
    bins = bins or max(5, min(20, round(math.sqrt(len(values)))))
    width = (high - low) / bins if high > low else 1.0
    counts: list[Counter[str]] = [Counter() for _ in range(bins)]
    for m in marks:
        counts[min(bins - 1, int((m.value - low) / width)) if high > low else bins // 2][m.cause] += 1
    top = max(sum(c.values()) for c in counts)
    frame = _Frame((low, low + width * bins if high > low else low + 1.0), (0, top))
    edges = [low + i * width for i in range(bins + 1)] if high > low else [low, low + 1.0]
    body = frame.axes(xlabel, "episodes", _ticks(frame.x0, frame.x1), _ticks(0, top, 4))
    for i, count in enumerate(counts):
        x0, x1 = (frame.px(edges[i]), frame.px(edges[i + 1])) if high > low else (frame.px(low), frame.px(low + 1))
        below = 0
        for c in CAUSES:
            if not count[c]:
                continue
            y0, y1 = frame.py(below), frame.py(below + count[c])
            below += count[c]
            body.append(f'<rect class="mark" data-cause="{esc(c)}" data-n="{count[c]}" x="{x0 + 0.5:.1f}" '
                        f'y="{y1:.1f}" width="{max(1.0, x1 - x0 - 1):.1f}" height="{y0 - y1:.1f}" '
                        f'fill="{COLOURS.get(c, INK)}"><title>{count[c]} {esc(c)} in [{esc(_fmt(edges[i]))}, '
                        f"{esc(_fmt(edges[min(i + 1, len(edges) - 1)]))})</title></rect>")
    keys, used = legend(_cause_keys(marks, None, "box"), HEIGHT, WIDTH)
    if hollow_text and any(m.hollow for m in marks):
        more, extra = legend([("box", "#fff", f"{sum(m.hollow for m in marks)} {hollow_text}")], HEIGHT + used, WIDTH)
        keys, used = keys + more, used + extra
    return _svg("histogram", title, body + keys, WIDTH, HEIGHT + used)


def distribution(marks: Sequence[Mark], title: str, xlabel: str, hollow_text: str) -> str:
    """A strip plot where episodes are few (every one its own dot), else a stacked histogram."""
    if len(marks) < STRIP_LIMIT:
        return strip(marks, title, xlabel, hollow_text)
    return histogram(marks, title, xlabel, hollow_text)


def ecdf(marks: Sequence[Mark], title: str, xlabel: str, missing: int = 0) -> str:
    """The fraction of episodes that took at most x: a step line, a dot per episode on it."""
    if not marks:
        return empty(title)
    ordered = sorted(marks, key=lambda m: m.value)
    n = len(ordered)
    low, high = ordered[0].value, ordered[-1].value
    pad = (high - low) * 0.05 or max(abs(low) * 0.05, 0.05)
    frame = _Frame((max(0.0, low - pad), high + pad), (0, 1))
    body = frame.axes(xlabel, "fraction ≤ x", _ticks(frame.x0, frame.x1), [0, 0.5, 1])
    points = [f"{frame.px(frame.x0):.1f},{frame.py(0):.1f}"]
    for i, m in enumerate(ordered):
        x = frame.px(m.value)
        points += [f"{x:.1f},{frame.py(i / n):.1f}", f"{x:.1f},{frame.py((i + 1) / n):.1f}"]
    points.append(f"{frame.px(frame.x1):.1f},{frame.py(1):.1f}")
    body.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="{INK}" stroke-width="1.5"/>')
    for i, m in enumerate(ordered):
        body.append(_dot(frame.px(m.value), frame.py((i + 1) / n), m, f"{_fmt(m.value)} s"))
    keys = _cause_keys(ordered, None)
    if missing:
        keys.append(("box", "#fff", f"{missing} without a duration (crashed)"))
    marks_svg, used = legend(keys, HEIGHT, WIDTH)
    return _svg("ecdf", title, body + marks_svg, WIDTH, HEIGHT + used)

