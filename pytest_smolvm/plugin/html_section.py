"""The eval figures as a section of the pytest-html report (``--html``), when pytest-html is there.

Registered only where pytest-html's hook exists, and the hook runs only when pytest-html writes
a report; the figures (``evals/results/figures.py``, the ``results --html`` report's own) are
imported only then, so a run without pytest-html pays nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# pytest-html writes the section into its own page: our layout rules go with it, scoped.
STYLE = (".smolvm-evals .plots{display:flex;flex-wrap:wrap;gap:12px}.smolvm-evals .plot{border:1px solid #eee;"
         "background:#fff}.smolvm-evals .method{color:#555;font-size:.9em}"
         ".smolvm-evals code{white-space:pre-wrap;word-break:break-all}")


class HtmlSection:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_html_results_summary(self, prefix: list[str], summary: list[str], postfix: list[str],
                                    session: pytest.Session) -> None:
        episodes = self.config.pluginmanager.get_plugin("smolvm-episodes")
        section = self.section(list(getattr(episodes, "lines", [])))
        if section:
            postfix.append(section)

    def section(self, lines: list[dict[str, Any]]) -> str:
        from pytest_smolvm.evals.results.figures import METHOD, eval_lines, run_figures
        from pytest_smolvm.evals.results.svg import esc
        from pytest_smolvm.evals.reward import episode_lines

        lines = episode_lines(lines)
        if not lines:
            return ""
        where = getattr(self.config.option, "htmlpath", None)
        relative_to = Path(where).resolve().parent if where else None
        functions: dict[str, list[dict[str, Any]]] = {}
        for ln in eval_lines(lines):
            functions.setdefault(str(ln.get("function", "")), []).append(ln)
        parts = [f"<h3>{esc(name)}</h3>{run_figures(group, relative_to)}" for name, group in functions.items()]
        return (f'<div class="smolvm-evals"><style>{STYLE}</style><h2>smolvm episodes</h2>'
                f'<p class="method">{esc(METHOD)}</p>{"".join(parts)}</div>')
