"""The ``results --html`` report opened in a real browser (Chromium, headless, from the
distribution) with the network off: the plots render, the table sorts, nothing is fetched, no
console error, and the guest's markup in it does not run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pytest_smolvm.evals.results.html_report import report
from pytest_smolvm.evals.results.load import read
from tests import tools
from tests.browser import visit
from tests.test_results_html import hostile_run, line, write

# Runs in the page once it has loaded: what rendered, and what a click on a column head does.
PROBE = """(() => {
  const plots = Array.from(document.querySelectorAll("svg.plot")).map((svg) => {
    const box = svg.getBoundingClientRect();
    return {kind: svg.dataset.plot, width: box.width, height: box.height,
            marks: Array.from(svg.querySelectorAll(".mark")).filter((m) => {
              const b = m.getBoundingClientRect(); return b.width > 0 || b.height > 0; }).length};
  });
  const table = document.querySelector("table.episodes");
  const rewards = () => Array.from(table.tBodies[0].rows).map((r) => parseFloat(r.cells[3].dataset.v));
  const head = table.tHead.rows[0].cells[3];
  head.click();
  const up = rewards();
  head.click();
  const down = rewards();
  return JSON.stringify({plots, up, down, title: document.title, ready: document.body.dataset.ready,
                         rows: table.tBodies[0].rows.length, injected: document.querySelectorAll(
                           "body img, body iframe, script:not(:last-of-type)").length});
})()"""


def test_the_report_renders_in_headless_chromium_with_no_network(tmp_path: Path) -> None:
    chromium = tools.require("chromium", "the HTML report is checked in a real browser")
    base = hostile_run(tmp_path)
    other = write(tmp_path / "other.jsonl", [line(c, s, 1.0) for c in ("sort", "grep") for s in range(8)])
    out = tmp_path / "report.html"
    out.write_text(report([(base, read(base)), (other, read(other))], out))

    shot = os.environ.get("SMOLVM_REPORT_SCREENSHOT")  # docs/: the screenshot in evals.md
    page = visit(chromium, out, PROBE, screenshot=(1200, 1250) if shot else None)
    if shot and page.screenshot:
        Path(shot).write_bytes(page.screenshot)
    assert page.errors == []  # console errors, exceptions, CSP violations
    assert page.requests == [out.resolve().as_uri()]  # the page itself, nothing else
    seen = json.loads(page.value)
    assert seen["ready"] == "1" and seen["title"] == "pytest-smolvm results"  # our script ran, theirs did not
    assert seen["injected"] == 0
    kinds = {p["kind"] for p in seen["plots"]}
    assert kinds >= {"curve", "strip", "outcomes", "intervals"}
    for plot in seen["plots"]:
        assert plot["width"] > 100 and plot["height"] > 40 and plot["marks"] > 0, plot
    assert seen["rows"] == 16
    assert seen["up"] == sorted(seen["up"]) and seen["down"] == sorted(seen["down"], reverse=True)


def test_the_pytest_html_section_renders_in_headless_chromium(pytester: pytest.Pytester, smol_state: Path) -> None:
    chromium = tools.require("chromium", "the pytest-html report is checked in a real browser")
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("task", ["a", "b"])
        @pytest.mark.smol_episodes(3)
        def test_agent(smol_episode, task):
            smol_episode.record(smol_episode.index / 2)
            assert smol_episode.index < 2, "guest said <b>hi</b>"
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--html=report.html", "--self-contained-html")
    result.assert_outcomes(passed=4, failed=2)
    probe = """JSON.stringify(Array.from(document.querySelectorAll(".smolvm-evals svg.plot")).map((svg) => {
      const box = svg.getBoundingClientRect(); return [svg.dataset.plot, box.width, box.height]; }))"""
    page = visit(chromium, pytester.path / "report.html", probe)
    assert page.errors == []
    assert all(url.startswith("file://") for url in page.requests), page.requests
    plots = json.loads(page.value)
    assert {kind for kind, _, _ in plots} >= {"curve", "strip", "outcomes", "intervals"}
    assert all(width > 100 and height > 40 for _, width, height in plots), plots
