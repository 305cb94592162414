"""Plots as inline SVG text: histograms, strip plots, pass@k curves with a band, interval charts
and outcome bars, for the results report and the pytest-html section.

Drawn here rather than by a plotting library: the output is a few kilobytes of markup that needs
no script, font or network to show, is the same for the same data, and costs no dependency.
Every piece of text that reaches the markup goes through ``esc`` (labels are task names, and a
task name is whatever a test's parametrize id says).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pytest_smolvm.inert import inert

WIDTH, HEIGHT = 340, 170
_LEFT, _RIGHT, _TOP, _BOTTOM = 44, 12, 14, 34
COLOURS = {"passed": "#2e7d32", "failed": "#c62828", "timeout": "#ef6c00", "oom": "#6a1b9a",
           "setup": "#546e7a", "skipped": "#9e9e9e", "crashed": "#000000"}
INK, BAND, GRID = "#1f4e79", "#9ec5e8", "#dddddd"


def esc(text: object) -> str:
    """Text for HTML or SVG: control characters shown as escapes, markup characters as entities."""
    return html.escape(inert(str(text)), quote=True)


@dataclass(frozen=True)
class Span:
    """An estimate with its interval, as the plots need it (``stats.Interval`` has this shape)."""

    estimate: float
    low: float
    high: float


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def _svg(kind: str, title: str, body: list[str], width: int = WIDTH, height: int = HEIGHT) -> str:
    return (f'<svg class="plot" data-plot="{esc(kind)}" xmlns="http://www.w3.org/2000/svg" role="img" '
            f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" aria-label="{esc(title)}">'
            f"<title>{esc(title)}</title>{''.join(body)}</svg>")


class _Frame:
    """A plot area with linear x and y scales, and the axes drawn around it."""

    def __init__(self, x: tuple[float, float], y: tuple[float, float], width: int = WIDTH,
                 height: int = HEIGHT, left: int = _LEFT) -> None:
        self.x0, self.x1 = x if x[1] > x[0] else (x[0] - 0.5, x[0] + 0.5)
        self.y0, self.y1 = y if y[1] > y[0] else (y[0] - 0.5, y[0] + 0.5)
        self.width, self.height, self.left = width, height, left

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * (self.width - self.left - _RIGHT)

    def py(self, y: float) -> float:
        return self.height - _BOTTOM - (y - self.y0) / (self.y1 - self.y0) * (self.height - _TOP - _BOTTOM)

    def axes(self, xlabel: str, ylabel: str, xticks: Sequence[float], yticks: Sequence[float]) -> list[str]:
        bottom, left = self.height - _BOTTOM, self.left
        out = [f'<line x1="{left}" y1="{bottom}" x2="{self.width - _RIGHT}" y2="{bottom}" stroke="#555"/>',
               f'<line x1="{left}" y1="{_TOP}" x2="{left}" y2="{bottom}" stroke="#555"/>']
        for t in xticks:
            x = self.px(t)
            out.append(f'<text x="{x:.1f}" y="{bottom + 13}" font-size="10" text-anchor="middle">{esc(_fmt(t))}</text>')
        for t in yticks:
            y = self.py(t)
            out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{self.width - _RIGHT}" y2="{y:.1f}" stroke="{GRID}"/>')
            out.append(f'<text x="{left - 4}" y="{y + 3:.1f}" font-size="10" text-anchor="end">{esc(_fmt(t))}</text>')
        out.append(f'<text x="{(left + self.width - _RIGHT) / 2:.1f}" y="{self.height - 4}" font-size="11" '
                   f'text-anchor="middle">{esc(xlabel)}</text>')
        if ylabel:
            out.append(f'<text x="11" y="{(_TOP + bottom) / 2:.1f}" font-size="11" text-anchor="middle" '
                       f'transform="rotate(-90 11 {(_TOP + bottom) / 2:.1f})">{esc(ylabel)}</text>')
        return out


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(low / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((high - first) / step + 1e-9) + 1)]


def histogram(values: Sequence[float], title: str, xlabel: str, bins: int = 0) -> str:
    """Counts of ``values`` in equal bins (about √n of them, 5 to 20)."""
    if not values:
        return empty(title)
    low, high = min(values), max(values)
    bins = bins or max(5, min(20, round(math.sqrt(len(values)))))
    width = (high - low) / bins if high > low else 1.0
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - low) / width)) if high > low else bins // 2] += 1
    top = max(counts)
    frame = _Frame((low, low + width * bins if high > low else low + 1.0), (0, top))
    edges = [low + i * width for i in range(bins + 1)] if high > low else [low, low + 1.0]
    body = frame.axes(xlabel, "episodes", _ticks(frame.x0, frame.x1), _ticks(0, top, 4))
    for i, count in enumerate(counts):
        if not count:
            continue
        x0, x1 = (frame.px(edges[i]), frame.px(edges[i + 1])) if high > low else (frame.px(low), frame.px(low + 1))
        y = frame.py(count)
        body.append(f'<rect class="mark" x="{x0 + 0.5:.1f}" y="{y:.1f}" width="{max(1.0, x1 - x0 - 1):.1f}" '
                    f'height="{frame.py(0) - y:.1f}" fill="{INK}"><title>{count} in '
                    f"[{esc(_fmt(edges[i]))}, {esc(_fmt(edges[min(i + 1, len(edges) - 1)]))})</title></rect>")
    return _svg("histogram", title, body)


def strip(values: Sequence[float], title: str, xlabel: str, colours: Sequence[str] = ()) -> str:
    """One dot per value along x, spread over y in a fixed pattern so equal values stay visible."""
    if not values:
        return empty(title)
    low, high = min(values), max(values)
    pad = (high - low) * 0.05 or 0.5
    frame = _Frame((low - pad, high + pad), (0, 1))
    body = frame.axes(xlabel, "", _ticks(frame.x0, frame.x1), [])
    for i, v in enumerate(values):
        colour = colours[i] if i < len(colours) else INK
        y = frame.py(0.15 + 0.7 * ((i * 0.618034) % 1.0))
        body.append(f'<circle class="mark" cx="{frame.px(v):.1f}" cy="{y:.1f}" r="4" fill="{colour}" '
                    f'fill-opacity="0.75"><title>{esc(_fmt(v))}</title></circle>')
    return _svg("strip", title, body)


def distribution(values: Sequence[float], title: str, xlabel: str, colours: Sequence[str] = ()) -> str:
    """A strip plot where episodes are few (every one visible), else a histogram."""
    return strip(values, title, xlabel, colours) if len(values) < 30 else histogram(values, title, xlabel)


def curve(points: Sequence[Span], title: str, xlabel: str, ylabel: str) -> str:
    """``points[i]`` at x = i + 1: the estimate as a line over its interval as a band (pass@k)."""
    if not points:
        return empty(title)
    n = len(points)
    frame = _Frame((1, max(n, 2)), (0, 1))
    body = frame.axes(xlabel, ylabel, _ticks(1, max(n, 2), min(n, 6)) if n > 1 else [1], [0, 0.5, 1])
    xs = [frame.px(i + 1) for i in range(n)]
    spans = list(points)
    if n == 1:  # a band needs some width: six pixels either side of the one k
        xs, spans = [xs[0] - 6, xs[0] + 6], spans * 2
    upper = [f"{x:.1f},{frame.py(p.high):.1f}" for x, p in zip(xs, spans, strict=True)]
    lower = [f"{x:.1f},{frame.py(p.low):.1f}" for x, p in zip(xs, spans, strict=True)]
    body.append(f'<polygon class="band" points="{" ".join(upper + lower[::-1])}" fill="{BAND}" fill-opacity="0.6"/>')
    line = " ".join(f"{frame.px(i + 1):.1f},{frame.py(p.estimate):.1f}" for i, p in enumerate(points))
    body.append(f'<polyline class="mark" points="{line}" fill="none" stroke="{INK}" stroke-width="2"/>')
    for i, p in enumerate(points):
        body.append(f'<circle class="mark" cx="{frame.px(i + 1):.1f}" cy="{frame.py(p.estimate):.1f}" r="3" '
                    f'fill="{INK}"><title>{esc(xlabel)} {i + 1}: {p.estimate:.3f} [{p.low:.3f}, {p.high:.3f}]'
                    f"</title></circle>")
    return _svg("curve", title, body)


def intervals(rows: Sequence[tuple[str, Span, bool]], title: str, xlabel: str, zero: bool = False) -> str:
    """One row per label: the estimate as a dot on its interval; ``True`` rows drawn in red.
    With ``zero``, a dashed line at 0 (the comparison: an interval that misses it is flagged)."""
    if not rows:
        return empty(title)
    labels = [_clip(label, 40) for label, _, _ in rows]  # the tail: where task names differ
    left = min(260, 16 + 6 * max(len(label) for label in labels))
    row_height = 22
    height = _TOP + _BOTTOM + row_height * len(rows)
    width = WIDTH + left
    low = min([s.low for _, s, _ in rows] + ([0.0] if zero else []))
    high = max([s.high for _, s, _ in rows] + ([0.0] if zero else []))
    pad = (high - low) * 0.05 or 0.5
    frame = _Frame((low - pad, high + pad), (0, len(rows)), width, height, left)
    body = frame.axes(xlabel, "", _ticks(low - pad, high + pad), [])
    if zero:
        body.append(f'<line x1="{frame.px(0):.1f}" y1="{_TOP}" x2="{frame.px(0):.1f}" y2="{height - _BOTTOM}" '
                    f'stroke="#888" stroke-dasharray="4 3"/>')
    for i, ((label, span, flagged), shown) in enumerate(zip(rows, labels, strict=True)):
        y = _TOP + row_height * (i + 0.5)
        colour = COLOURS["failed"] if flagged else INK
        body.append(f'<line class="mark" x1="{frame.px(span.low):.1f}" y1="{y:.1f}" x2="{frame.px(span.high):.1f}" '
                    f'y2="{y:.1f}" stroke="{colour}" stroke-width="2"/>')
        body.append(f'<circle class="mark" cx="{frame.px(span.estimate):.1f}" cy="{y:.1f}" r="4" fill="{colour}">'
                    f"<title>{esc(label)}: {span.estimate:+.3f} [{span.low:+.3f}, {span.high:+.3f}]</title></circle>")
        body.append(f'<text x="{left - 8}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{esc(shown)}</text>')
    return _svg("intervals", title, body, width, height)


def outcome_bar(counts: Sequence[tuple[str, int]], title: str) -> str:
    """One horizontal bar split by cause, with a legend."""
    total = sum(n for _, n in counts)
    if not total:
        return empty(title)
    width, height = WIDTH + 100, 64
    span = width - 20
    x = 10.0
    body = []
    for cause, n in counts:
        if not n:
            continue
        w = span * n / total
        colour = COLOURS.get(cause, INK)
        body.append(f'<rect class="mark" x="{x:.1f}" y="8" width="{w:.1f}" height="22" fill="{colour}">'
                    f"<title>{esc(cause)}: {n}</title></rect>")
        x += w
    lx = 10
    for cause, n in counts:
        if not n:
            continue
        colour = COLOURS.get(cause, INK)
        text = f"{cause} {n}"
        body.append(f'<rect x="{lx}" y="42" width="10" height="10" fill="{colour}"/>'
                    f'<text x="{lx + 14}" y="51" font-size="11">{esc(text)}</text>')
        lx += 22 + 7 * len(text)
    return _svg("outcomes", title, body, width, height)


def empty(title: str) -> str:
    body = [f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" font-size="12" text-anchor="middle" fill="#777">'
            f"nothing to plot</text>"]
    return _svg("empty", title, body)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else "…" + text[len(text) - limit + 1:]
