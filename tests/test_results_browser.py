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
from pytest_smolvm.evals.results.svg import DIRECTIONS
from tests import tools
from tests.browser import png_colours, visit
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
  // what the first screen (the screenshot) holds: each legend key's text and each direction mark
  const onScreen = (e) => { const b = e.getBoundingClientRect();
                            return b.width > 0 && b.top >= 0 && b.bottom <= window.innerHeight; };
  const keys = Array.from(document.querySelectorAll("svg.plot .legend .key")).filter(onScreen)
    .map((k) => k.textContent);
  const directions = Array.from(document.querySelectorAll("svg.plot [data-direction]")).filter(onScreen)
    .map((m) => m.dataset.direction);
  return JSON.stringify({plots, up, down, keys, directions, title: document.title, ready: document.body.dataset.ready,
                         rows: table.tBodies[0].rows.length, injected: document.querySelectorAll(
                           "body img, body iframe, script:not(:last-of-type)").length});
})()"""


def _rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def test_the_report_renders_in_headless_chromium_with_no_network(tmp_path: Path) -> None:
    chromium = tools.require("chromium", "the HTML report is checked in a real browser")
    steady = [line("cat", s, 0.5 + (s % 2) / 10) for s in range(8)]
    crashed = [{**line("sed", s, None), "outcome": "failed", "cause": "failed", "message": "no reward: the agent died"}
               for s in range(2)]  # scored 0 by the convention: hollow dots, counted beside the mean
    base = write(tmp_path / "base.jsonl", [*read(hostile_run(tmp_path)), *steady, *crashed])
    # against the base: sort better, grep worse, cat no evidence either way
    other = write(tmp_path / "other.jsonl", [line(c, s, r) for c, r in (("sort", 1.0), ("grep", 0.0)) for s in range(8)]
                  + [{**ln, "reward": 0.5 + ((ln["episode"] + 1) % 2) / 10} for ln in steady])
    out = tmp_path / "report.html"
    # named as a user names them on the command line, from the folder the files are in
    out.write_text(report([(Path(base.name), read(base)), (Path(other.name), read(other))], out))

    page = visit(chromium, out, PROBE, screenshot=(1200, 1250))
    shot = os.environ.get("SMOLVM_REPORT_SCREENSHOT")  # docs/: the screenshot in evals.md
    if shot and page.screenshot:
        Path(shot).write_bytes(page.screenshot)
    assert page.errors == []  # console errors, exceptions, CSP violations
    assert page.requests == [out.resolve().as_uri()]  # the page itself, nothing else
    seen = json.loads(page.value)
    assert seen["ready"] == "1" and seen["title"] == "pytest-smolvm results"  # our script ran, theirs did not
    assert seen["injected"] == 0
    kinds = {p["kind"] for p in seen["plots"]}
    assert kinds >= {"curve", "strip", "ecdf", "outcomes", "intervals"}
    for plot in seen["plots"]:
        assert plot["width"] > 100 and plot["height"] > 40 and plot["marks"] > 0, plot
    assert seen["rows"] == 26
    assert seen["up"] == sorted(seen["up"]) and seen["down"] == sorted(seen["down"], reverse=True)
    # The first screen shows the comparison with its three directions and their key, and the
    # base run's plots with theirs; the screenshot has each direction's colour in it.
    assert sorted(seen["directions"]) == ["better", "no evidence", "worse"]
    for key in ("better: interval above 0", "worse: interval below 0", "no evidence: interval spans 0",
                "passed 10", "failed 15", "no reward recorded: pass 1, fail 0"):
        assert key in seen["keys"], seen["keys"]
    assert page.screenshot is not None
    colours = png_colours(page.screenshot)
    for direction, colour in DIRECTIONS.items():
        assert colours.get(_rgb(colour), 0) >= 40, direction  # a mark and its key, solid


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
