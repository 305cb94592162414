"""One reward convention and one order across every view of a results file (issue 44): the
end-of-run table, ``pytest-smolvm results`` in the terminal, the HTML headers, every chart and
the comparison agree on each task's mean; shuffled lines give the same bytes; every attempted
episode is a mark in its task's plots, failures marked; comparison colours say the direction,
with a key; ``info`` fields are columns; a kept transcript is one click from its dot."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm.evals.results.html_report import report
from pytest_smolvm.evals.results.load import read
from pytest_smolvm.evals.results.terminal import comparison, run_summary
from tests.test_results_html import line, results_cli, write

TASK = "t.py::test_agent[{}]"
NAME = Path("run.jsonl")


def crashy_run(tmp_path: Path) -> list[dict[str, Any]]:
    """``crashy``: 2 of 8 passed with high rewards, 6 ended without one (3 crashed, a timeout, a
    failure, a setup error). ``steady``: 8 passed with middling rewards. By recorded rewards alone
    ``crashy`` (0.85) would look better than ``steady`` (0.535); scored, it is 0.2125."""
    lines = [line("crashy", 0, 0.9), line("crashy", 1, 0.8)]
    for seed, (outcome, why) in enumerate([("error", "crashed")] * 3 + [("failed", "timeout"), ("failed", "failed"),
                                          ("error", "setup")], start=2):
        lines.append({**line("crashy", seed, None), "outcome": outcome, "cause": why, "message": f"{why} here"})
        if why == "crashed":
            lines[-1].update(crashed=True, durations={})
    lines[5]["artifacts"] = str(tmp_path / "art" / "crashy-ep5")  # the timeout kept its transcript
    lines += [line("steady", s, 0.5 + s / 100, info={"agent_seconds": 1.5 + s, "tool": f"t{s % 2}"})
              for s in range(8)]
    return lines


def _group(page: str, task: str) -> str:
    return next(part for part in page.split('<section class="group">') if f">{TASK.format(task)}</h4>" in part)


def _svg(section: str, kind: str) -> str:
    start = section.index(f'data-plot="{kind}"')
    return section[start:section.index("</svg>", start)]


def test_one_mean_per_task_in_table_terminal_html_chart_and_comparison(tmp_path: Path) -> None:
    base = crashy_run(tmp_path)
    zero = [{**ln, "reward": 0.0, "outcome": "failed", "cause": "failed", "crashed": False} for ln in base]
    lines = read(write(tmp_path / "a.jsonl", base))
    terminal = "\n".join(run_summary(NAME, lines) + comparison(Path("z.jsonl"), read(write(tmp_path / "z.jsonl",
                                                                                             zero)), NAME, lines))
    page = report([(NAME, lines), (Path("z.jsonl"), read(tmp_path / "z.jsonl"))], tmp_path / "r.html")
    for task, expected in (("crashy", (0.9 + 0.8) / 8), ("steady", sum(0.5 + s / 100 for s in range(8)) / 8)):
        shown = f"{expected:.3f}"
        table_row = next(r for r in terminal.splitlines() if r.startswith(f"  [{task}] "))
        assert table_row.split()[7] == shown, table_row  # the summary table's mean column
        assert re.search(rf"\[{task}\]: reward {shown} \[", terminal)  # the interval line under it
        assert re.search(rf"test_agent\[{task}\]: \+{shown} \[", terminal)  # this run minus an all-zero run
        header = re.search(r"mean [^<]*<b[^>]*>([0-9.]+)</b>", _group(page, task))
        assert header is not None and header.group(1) == shown  # the HTML header
        assert f"<title>{TASK.format(task)}: +{shown} [" in page  # the per-task chart
        assert f"<title>{TASK.format(task)}: -{shown} [" in page  # the HTML comparison, other minus base
    # the count of episodes scored 0 for want of a reward stands beside the mean
    assert "6 of 8 failed without a reward, scored 0" in _group(page, "crashy")
    assert re.search(r"\[crashy\]: reward 0\.21[23] \[.*\] \(6 of 8 failed without a reward, scored 0\)$",
                     terminal, re.M)


def test_lines_in_another_order_give_the_same_terminal_and_html(tmp_path: Path) -> None:
    lines = crashy_run(tmp_path)
    first = read(write(tmp_path / "a.jsonl", lines))
    terminal, page = run_summary(NAME, first), report([(NAME, first)], tmp_path / "r.html")
    rng = random.Random(44)
    for attempt in range(3):
        shuffled = list(lines)
        rng.shuffle(shuffled)
        again = read(write(tmp_path / f"s{attempt}.jsonl", shuffled))
        assert run_summary(NAME, again) == terminal
        assert report([(NAME, again)], tmp_path / "r.html") == page


def test_the_end_of_run_table_and_the_results_command_agree(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol_episodes(4)
        def test_agent(smol_episode):
            if smol_episode.index < 2:
                smol_episode.record(0.9)
            else:
                raise RuntimeError("the agent crashed before any reward")
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-results=r.jsonl")
    result.assert_outcomes(passed=2, failed=2)
    in_run = [ln for ln in result.stdout.lines if ln.startswith("test_") and "test_agent " in ln]
    done = results_cli(str(pytester.path / "r.jsonl"))
    assert done.returncode == 0, done.stderr
    after = [ln for ln in done.stdout.splitlines() if ln.startswith("test_") and "test_agent " in ln]
    assert in_run == after and len(in_run) == 1
    assert in_run[0].split()[7] == "0.450"  # (0.9 + 0.9 + 0 + 0) / 4, not 0.900
    result.stdout.fnmatch_lines(["*test_agent: reward 0.450 [[]*] (2 of 4 failed without a reward, scored 0)"])


def test_every_attempted_episode_is_a_mark_and_failures_are_marked(tmp_path: Path) -> None:
    lines = [*crashy_run(tmp_path), {**line("crashy", 9, None), "outcome": "skipped", "cause": "skipped"}]
    page = report([(NAME, read(write(tmp_path / "a.jsonl", lines)))], tmp_path / "r.html")
    crashy = _group(page, "crashy")
    strip = _svg(crashy, "strip")
    assert strip.count('class="mark episode"') == 8  # the skipped one is no attempt
    assert strip.count('fill="#fff"') >= 6 and "no reward recorded: pass 1, fail 0" in strip  # hollow, keyed
    assert [c for c in ("passed", "timeout", "failed", "setup", "crashed") if f'data-cause="{c}"' not in strip] == []
    ecdf = _svg(crashy, "ecdf")  # durations: crashed workers recorded none, and the plot says so
    assert ecdf.count('class="mark episode"') == 5 and "3 without a duration (crashed)" in ecdf
    assert 'class="legend"' in ecdf and "fraction ≤ x" in ecdf
    # a kept transcript is one click from the episode's dot
    assert '<a href="art/crashy-ep5/transcript.txt"><circle class="mark episode" data-cause="timeout"' in strip
    row = next(r for r in page.split("<tr>") if "crashy-ep5" in r and "<td>" in r)  # and from its table row
    for href in ("art/crashy-ep5/transcript.txt", "art/crashy-ep5/guest-logs.txt", "art/crashy-ep5"):
        assert f'href="{href}"' in row, href


def test_a_histogram_keeps_every_episode_stacked_by_cause(tmp_path: Path) -> None:
    lines = [line("many", s, None if s % 3 == 0 else s / 40) for s in range(40)]
    for ln in lines[::3]:
        ln.update(outcome="failed", cause="failed")
    page = report([(NAME, read(write(tmp_path / "a.jsonl", lines)))], tmp_path / "r.html")
    histogram = _svg(page, "histogram")
    assert sum(int(n) for n in re.findall(r'data-n="(\d+)"', histogram)) == 40
    assert "14 no reward recorded: pass 1, fail 0" in histogram and 'class="legend"' in histogram


def test_comparison_colours_say_the_direction_with_a_key(tmp_path: Path) -> None:
    base = [line(t, s, 0.5 + (s % 2) / 10) for t in ("up", "down", "same") for s in range(8)]
    other = [{**ln, "reward": {"up": 0.9, "down": 0.1}.get(ln["case"], 0.5 + ((ln["seed"] + 1) % 2) / 10)}
             for ln in base]
    a, b = write(tmp_path / "a.jsonl", base), write(tmp_path / "b.jsonl", other)
    page = report([(a, read(a)), (b, read(b))], tmp_path / "r.html")
    chart = page[page.index('<section class="comparison">'):]
    for task, direction, colour in (("up", "better", "#1a9850"), ("down", "worse", "#d73027"),
                                    ("same", "no evidence", "#8a8a8a")):
        assert re.search(rf'data-direction="{direction}" [^>]*fill="{colour}"><title>{re.escape(TASK.format(task))}',
                         chart), task
        assert f'<span class="flag flag-{direction.split()[0] if direction != "no evidence" else "none"}">' \
               f"{direction}</span>" in chart
    for key in ("better: interval above 0", "worse: interval below 0", "no evidence: interval spans 0"):
        assert key in chart
    terminal = "\n".join(comparison(a, read(a), b, read(b)))
    assert re.search(r"test_agent\[up\]: \+0\.350 .* over 8 pairs  better$", terminal, re.M)
    assert re.search(r"test_agent\[down\]: -0\.450 .* over 8 pairs  WORSE$", terminal, re.M)
    assert re.search(r"test_agent\[same\]: \+0\.000 .* over 8 pairs$", terminal, re.M)


def test_info_fields_are_columns_of_the_episode_table(tmp_path: Path) -> None:
    page = report([(NAME, read(write(tmp_path / "a.jsonl", crashy_run(tmp_path))))], tmp_path / "r.html")
    table = page[page.index('<table class="sortable episodes">'):]
    assert '<th data-type="num">info.agent_seconds</th>' in table and '<th data-type="text">info.tool</th>' in table
    assert '<td class="num" data-v="8.5">8.5</td>' in table and "<td><code>t1</code></td>" in table
