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
# A comparison's per-task change, by what its interval says (higher reward is better): a colour
# and a shape each (up, down, round), so the direction reads without telling red from green.
DIRECTIONS = {"better": "#1a9850", "worse": "#d73027", "no evidence": "#8a8a8a"}
DIRECTION_SHAPES = {"better": "up", "worse": "down", "no evidence": "dot"}
DIRECTION_TEXT = {"better": "better: interval above 0", "worse": "worse: interval below 0",
                  "no evidence": "no evidence: interval spans 0"}


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


def legend(items: Sequence[tuple[str, str, str]], top: float, width: int) -> tuple[list[str], int]:
    """``(shape, colour, text)`` items left to right under a plot, wrapping at ``width``; the
    markup and the height it takes. Shapes: ``dot``, ``ring`` (hollow dot), ``box``, ``line``,
    ``up`` and ``down`` (triangles)."""
    out, x, y = ['<g class="legend">'], 10.0, top + 12
    for shape, colour, text in items:
        step = 26 + 6.2 * len(text)
        if x > 10 and x + step > width:
            x, y = 10.0, y + 15
        mark = {"dot": f'<circle cx="{x + 5:.1f}" cy="{y - 4:.1f}" r="4" fill="{colour}"/>',
                "up": triangle(x + 5, y - 4, 5, colour, up=True),
                "down": triangle(x + 5, y - 4, 5, colour, up=False),
                "ring": f'<circle cx="{x + 5:.1f}" cy="{y - 4:.1f}" r="3.5" fill="#fff" stroke="{colour}" '
                        f'stroke-width="1.6"/>',
                "box": f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="10" height="10" fill="{colour}"/>',
                "line": f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 11:.1f}" y2="{y - 4:.1f}" stroke="{colour}" '
                        f'stroke-width="2"/>'}[shape]
        out.append(f'<g class="key">{mark}<text x="{x + 15:.1f}" y="{y:.1f}" font-size="11">{esc(text)}</text></g>')
        x += step
    out.append("</g>")
    return out, int(y - top + 6)


def triangle(x: float, y: float, r: float, colour: str, *, up: bool, extra: str = "", inner: str = "") -> str:
    """A triangle centred on (x, y), pointing up or down."""
    tip, base = (y - r, y + r * 0.8) if up else (y + r, y - r * 0.8)
    return (f'<polygon {extra}points="{x:.1f},{tip:.1f} {x - r:.1f},{base:.1f} {x + r:.1f},{base:.1f}" '
            f'fill="{colour}">{inner}</polygon>')


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


def intervals(rows: Sequence[tuple[str, Span, str | None]], title: str, xlabel: str, zero: bool = False) -> str:
    """One row per label: the estimate as a dot on its interval. With ``zero`` (a comparison), a
    dashed line at 0 and each row coloured by its direction (``DIRECTIONS``: ``"better"``,
    ``"worse"``, None for no evidence), with the key under the plot."""
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
    for i, ((label, span, direction), shown) in enumerate(zip(rows, labels, strict=True)):
        y = _TOP + row_height * (i + 0.5)
        word = direction or "no evidence"
        colour = DIRECTIONS[word] if zero else INK
        what = f" ({word})" if zero else ""
        body.append(f'<line class="mark" x1="{frame.px(span.low):.1f}" y1="{y:.1f}" x2="{frame.px(span.high):.1f}" '
                    f'y2="{y:.1f}" stroke="{colour}" stroke-width="2"/>')
        tip = (f"<title>{esc(label)}: {span.estimate:+.3f} [{span.low:+.3f}, {span.high:+.3f}]{esc(what)}"
               "</title>")
        x = frame.px(span.estimate)
        if zero and word != "no evidence":
            body.append(triangle(x, y, 6, colour, up=word == "better", inner=tip,
                                 extra=f'class="mark" data-direction="{esc(word)}" '))
        else:
            direction_attr = f'data-direction="{esc(word)}" ' if zero else ""
            body.append(f'<circle class="mark" {direction_attr}cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{colour}">'
                        f"{tip}</circle>")
        body.append(f'<text x="{left - 8}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{esc(shown)}</text>')
    if zero:
        keys = [(DIRECTION_SHAPES[d], DIRECTIONS[d], DIRECTION_TEXT[d]) for d in DIRECTIONS]
    else:
        keys = [("dot", INK, "mean"), ("line", INK, "95% bootstrap interval")]
    marks, used = legend(keys, height, width)
    return _svg("intervals", title, body + marks, width, height + used)


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
