"""``pytest-smolvm results ... --html OUT.html``: one self-contained page.

Everything is inside the file: the plots are inline SVG, the style and the table-sorting script
inline. A Content-Security-Policy in the page allows nothing to be fetched (``default-src
'none'``) and runs no script but ours (by hash), so even text that escaped our escaping could
neither load anything nor run. Guest-made text (failure messages quote guest output) goes through
``svg.esc``: control characters shown as escapes, markup as entities.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_smolvm.evals.results.figures import METHOD, duration, eval_lines, log_links, run_figures
from pytest_smolvm.evals.results.load import cause
from pytest_smolvm.evals.results.stats import baseline_digests, compare
from pytest_smolvm.evals.results.svg import Span, esc, intervals
from pytest_smolvm.evals.reward import score, task_of

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plot{border:1px solid #eee;background:#fff}
.facts{color:#333}.note{color:#8a4b00}.method{color:#555;font-size:.9em}
table{border-collapse:collapse;font-size:.9em}td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}
th{cursor:pointer;background:#f4f4f4;user-select:none}th[data-dir=asc]::after{content:" \\25b2"}
th[data-dir=desc]::after{content:" \\25bc"}td.num{text-align:right;font-variant-numeric:tabular-nums}
.cause{font-weight:600}.cause-passed{color:#2e7d32}.cause-failed{color:#c62828}.cause-timeout{color:#ef6c00}
.cause-oom{color:#6a1b9a}.cause-setup{color:#546e7a}.cause-crashed{color:#000}.flag{font-weight:600}
.flag-better{color:#1a9850}.flag-worse{color:#d73027}.flag-none{color:#8a8a8a}
code{white-space:pre-wrap;word-break:break-all;font-size:.85em;color:#555}
"""
# Sorts a table by the clicked column: numbers by the cell's data-v (or its text), text as text.
SCRIPT = """
for (const table of document.querySelectorAll("table.sortable")) {
  const heads = Array.from(table.tHead.rows[0].cells);
  heads.forEach((th, column) => th.addEventListener("click", () => {
    const dir = th.dataset.dir === "asc" ? "desc" : "asc";
    heads.forEach((h) => delete h.dataset.dir);
    th.dataset.dir = dir;
    const numeric = th.dataset.type === "num";
    const key = (row) => {
      const cell = row.cells[column];
      const text = cell.dataset.v !== undefined ? cell.dataset.v : cell.textContent;
      const value = numeric ? parseFloat(text) : text;
      return numeric && Number.isNaN(value) ? -Infinity : value;
    };
    const rows = Array.from(table.tBodies[0].rows);
    const sign = dir === "asc" ? 1 : -1;
    rows.sort((a, b) => { const x = key(a), y = key(b); return (x < y ? -1 : x > y ? 1 : 0) * sign; });
    table.tBodies[0].append(...rows);
  }));
}
document.body.dataset.ready = "1";
"""


def _hash(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def page(title: str, body: str) -> str:
    policy = (f"default-src 'none'; style-src '{_hash(STYLE)}'; script-src '{_hash(SCRIPT)}'; "
              "img-src data:; base-uri 'none'; form-action 'none'")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{esc(policy)}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)}</title><style>{STYLE}</style></head>"
            f"<body>{body}<script>{SCRIPT}</script></body></html>\n")


def _num(value: float | None, digits: int = 3) -> tuple[str, str]:
    """(data-v, shown) for a numeric cell."""
    return ("", "-") if value is None else (repr(value), f"{value:.{digits}f}")


INFO_COLUMNS = 24  # the first this many info keys (sorted) get a column; the rest are counted
INFO_CHARS = 120


def _info_keys(lines: Sequence[dict[str, Any]]) -> tuple[list[tuple[str, str]], int]:
    """The info keys that get a column, each with its sort kind ("num" where every value is a number)."""
    values: dict[str, list[object]] = {}
    for ln in lines:
        for k, v in (ln["info"] if isinstance(ln.get("info"), dict) else {}).items():
            values.setdefault(str(k), []).append(v)
    keys = sorted(values)
    kinds = [(k, "num" if all(_is_number(v) for v in values[k]) else "text") for k in keys[:INFO_COLUMNS]]
    return kinds, max(0, len(keys) - INFO_COLUMNS)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _info_cell(value: object) -> str:
    """A recorded info value: numbers sortable as numbers, anything else as compact JSON, cut."""
    if isinstance(value, (int, float)) and _is_number(value):
        return f'<td class="num" data-v="{esc(repr(float(value)))}">{esc(value)}</td>'
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    shown = text if len(text) <= INFO_CHARS else text[:INFO_CHARS - 1] + "…"
    return f"<td><code>{esc(shown)}</code></td>"


def episode_table(lines: Sequence[dict[str, Any]], relative_to: Path | None) -> str:
    """A row per episode (canonical order): its reward under the convention, what it recorded as
    ``info`` (a column per key), and links to what the run kept of it."""
    info_keys, more = _info_keys(lines)
    heads = [("task", "text"), ("episode", "num"), ("seed", "num"), ("reward", "num"), ("outcome", "text"),
             ("duration s", "num"), *((f"info.{k}", kind) for k, kind in info_keys), ("baseline digest", "text"),
             ("transcript / logs", "text"), ("message", "text")]
    head = "".join(f'<th data-type="{kind}">{esc(name)}</th>' for name, kind in heads)
    rows = []
    for ln in lines:
        value = score(ln)
        reward_v, reward = _num(value)
        if value is not None and ln.get("reward") is None:  # scored by the convention: say so
            reward = f"{reward} (none recorded)"
        took_v, took = _num(duration(ln), 2)
        digest = str(ln.get("baseline_digest") or "")
        info: dict[str, Any] = ln["info"] if isinstance(ln.get("info"), dict) else {}
        c = cause(ln)
        episode, seed = ln.get("episode"), ln.get("seed")
        cells = [
            f"<td>{esc(task_of(ln))}</td>",
            f'<td class="num">{esc("" if episode is None else episode)}</td>',
            f'<td class="num">{esc("" if seed is None else seed)}</td>',
            f'<td class="num" data-v="{esc(reward_v)}">{esc(reward)}</td>',
            f'<td><span class="cause cause-{esc(c)}">{esc(c)}</span></td>',
            f'<td class="num" data-v="{esc(took_v)}">{esc(took)}</td>',
            *(_info_cell(info[k]) if k in info else "<td></td>" for k, _ in info_keys),
            f'<td title="{esc(digest)}">{esc(digest.removeprefix("sha256:")[:12])}</td>',
            f"<td>{log_links(ln, relative_to)}</td>",
            f"<td><code>{esc(str(ln.get('message') or '')[:200])}</code></td>",
        ]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    note = f'<p class="note">{more} more info keys not shown as columns.</p>' if more else ""
    return (f'{note}<table class="sortable episodes"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def comparison(base_name: str, base: Sequence[dict[str, Any]], other_name: str,
               other: Sequence[dict[str, Any]]) -> str:
    """Per-task reward differences (other - base, each episode scored by the one convention),
    paired by task and seed, coloured by direction: better (the interval is above zero), worse
    (below), no evidence (it spans zero); a note when the runs booted different baselines."""
    title = f"{other_name} vs {base_name}"
    out = [f'<section class="comparison"><h2>Comparison: {esc(title)}</h2>']
    a, b = baseline_digests(base), baseline_digests(other)
    if a != b:
        out.append(f'<p class="note">Different baseline digests ({esc(", ".join(sorted(a)) or "none")} vs '
                   f'{esc(", ".join(sorted(b)) or "none")}): not like for like.</p>')
    diffs = [d for d in compare(base, other) if d.difference is not None]
    if not diffs:
        out.append("<p>No episodes in common (same task and seed).</p></section>")
        return "".join(out)
    rows = [(d.task, Span(d.difference.estimate, d.difference.low, d.difference.high), d.direction)
            for d in diffs if d.difference is not None]
    out.append(intervals(rows, f"{title}: reward difference per task", "reward difference (other - base)",
                         zero=True))
    table = []
    for d in diffs:
        assert d.difference is not None
        word = d.direction or "no evidence"
        flag = f'<span class="flag flag-{d.direction or "none"}">{word}</span>'
        table.append(f"<tr><td>{esc(d.task)}</td><td class=\"num\">{d.pairs}</td>"
                     f'<td class="num" data-v="{d.difference.estimate!r}">{d.difference.estimate:+.3f}</td>'
                     f'<td class="num">[{d.difference.low:+.3f}, {d.difference.high:+.3f}]</td><td>{flag}</td></tr>')
    out.append('<table class="sortable differences"><thead><tr><th data-type="text">task</th>'
               '<th data-type="num">pairs</th><th data-type="num">difference</th><th data-type="text">95% interval'
               f'</th><th data-type="text">change</th></tr></thead><tbody>{"".join(table)}</tbody></table>')
    out.append("</section>")
    return "".join(out)


def report(runs: Sequence[tuple[Path, list[dict[str, Any]]]], out: Path) -> str:
    """The page for ``runs`` (the first is the base every later run is compared with). With two
    or more, the comparisons come first: "did it get better" is what a second run is for."""
    relative_to = out.resolve().parent
    names = [str(path) for path, _ in runs]
    body = [f"<h1>pytest-smolvm results: {esc(', '.join(names))}</h1>", f'<p class="method">{esc(METHOD)}</p>']
    for path, lines in runs[1:]:
        body.append(comparison(names[0], runs[0][1], str(path), lines))
    for path, lines in runs:
        episodes = eval_lines(lines)
        digests = ", ".join(sorted(baseline_digests(lines))) or "none recorded"
        backends = ", ".join(sorted({str(ln["backend"]) for ln in lines if ln.get("backend")})) or "unknown"
        body.append(f'<section class="run"><h2>Run {esc(path)}</h2><p>{len(episodes)} episodes; backend '
                    f"{esc(backends)}; baseline {esc(digests)}</p>{run_figures(lines, relative_to)}"
                    f"<h3>Episodes</h3>{episode_table(episodes, relative_to)}</section>")
    return page("pytest-smolvm results", "".join(body))
