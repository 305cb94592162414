"""``pytest-smolvm results --html``: one self-contained page, guest text inert in it, the
comparison of two real runs of the example eval suite; and the pytest-html section."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm.errors import ResultsError
from pytest_smolvm.evals.results.html_report import report
from pytest_smolvm.evals.results.load import read

ROOT = Path(__file__).resolve().parent.parent
EVALS = ROOT / "examples" / "evals"
# What an attacker-controlled message tries: markup, a script, an event handler, a terminal escape.
HOSTILE = ('<script>document.title="pwned"</script><img src=x onerror="document.title=1">'
           '</code></td></tr></table><svg onload="document.title=2">\x1b]52;c;aGk=\x07\x9b2J')


def line(case: str, seed: int, reward: float | None, **extra: Any) -> dict[str, Any]:
    outcome = "passed" if reward is None or reward > 0.5 else "failed"
    return {"v": 2, "test": f"t.py::test_agent[{case}-ep{seed}]", "function": "t.py::test_agent", "case": case,
            "params": {"task": case}, "episode": seed, "episodes": 8, "seed": 100 + seed, "outcome": outcome,
            "cause": outcome, "message": "", "reward": reward, "info": {},
            "durations": {"setup": 0.05, "call": 0.1 + seed / 100, "teardown": 0.01}, "vms": [],
            "backend": "namespace", "baseline": "bundled alpine", "baseline_digest": "sha256:" + "ab" * 32,
            "worker": "main", "run_id": "r1", "artifacts": None, **extra}


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    return path


def hostile_run(tmp_path: Path) -> Path:
    lines = [line(case, s, (s * 37 % 10) / 10) for case in ("sort", "grep") for s in range(8)]
    lines[3] = {**lines[3], "outcome": "failed", "cause": "timeout", "message": HOSTILE,
                "artifacts": str(tmp_path / "art" / "t.py_test_agent_sort-ep3")}
    lines[4] = {**lines[4], "case": 'x"><script>document.title=3</script>', "message": HOSTILE,
                "artifacts": "javascript:document.title=4"}
    return write(tmp_path / "hostile.jsonl", lines)


def results_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", "results", *args],
                          capture_output=True, text=True, timeout=120)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.styles.append(data)
            self._in_style = False


def assert_self_contained(page: str) -> None:
    """Nothing the page could fetch or run but our one script, read as a browser parses it."""
    parsed = _Tags()
    parsed.feed(page)
    names = [tag for tag, _ in parsed.tags]
    assert not {"link", "iframe", "object", "embed", "img", "audio", "video", "source", "frame", "base"} & set(names)
    assert names.count("script") == 1 and names.count("style") == 1
    for tag, attrs in parsed.tags:
        assert not {"src", "srcset", "poster", "data", "action"} & set(attrs), (tag, attrs)
        assert not [a for a in attrs if a.startswith("on")], (tag, attrs)  # no event handler anywhere
        href = attrs.get("href") or ""
        assert "://" not in href or href.startswith("file://"), href
    assert all("url(" not in s and "@import" not in s for s in parsed.styles)
    policy = next(a["content"] for t, a in parsed.tags if t == "meta" and a.get("http-equiv"))
    assert policy is not None and policy.startswith("default-src 'none';")


def test_the_report_is_one_self_contained_file_with_every_plot(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    page = report([(hostile_run(tmp_path), read(tmp_path / "hostile.jsonl"))], out)
    assert_self_contained(page)
    for kind in ("curve", "strip", "outcomes", "intervals"):
        assert f'data-plot="{kind}"' in page, kind
    assert "95% percentile bootstrap" in page and "Chen et al. 2021" in page
    assert page.count('<table class="sortable episodes">') == 1
    assert page.count("<tr><td>") >= 16  # a row per episode


def test_guest_text_in_the_report_is_inert(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    page = report([(hostile_run(tmp_path), read(tmp_path / "hostile.jsonl"))], out)
    assert_self_contained(page)  # parsed as a browser would: no injected tag, no event handler
    for raw in ("<script>document", "<img", "<svg onload", "</code></td></tr></table><svg", "\x1b", "\x07",
                "\x9b", 'x"><script>'):
        assert raw not in page, raw
    assert "&lt;script&gt;document.title=&quot;pwned&quot;&lt;/script&gt;" in page  # shown, not run
    assert "\\x1b]52;c;aGk=\\x07" in page  # the escape sequence is shown as text
    # A saved guest log is linked relative to the report; a path that looks like a URL scheme
    # cannot become one (its colon is percent-encoded).
    assert 'href="art/t.py_test_agent_sort-ep3/transcript.txt"' in page
    assert 'href="javascript:' not in page and "javascript%3Adocument.title%3D4/transcript.txt" in page


def test_the_html_command_compares_two_real_runs_of_the_example_suite(tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b"):
        runs.append(tmp_path / f"{name}.jsonl")
        subprocess.run([sys.executable, "-m", "pytest", "examples/evals", "-q", "-p", "no:cacheprovider",
                        f"--smol-results={runs[-1]}"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    out = tmp_path / "out" / "report.html"
    done = results_cli(str(runs[0]), str(runs[1]), "--html", str(out))
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    page = out.read_text()
    assert_self_contained(page)
    assert page.count('<section class="run">') == 2
    assert f"Comparison: {runs[1]} vs {runs[0]}" in page and "not like for like" not in page
    assert 'data-plot="intervals"' in page and "over 4 pairs" not in page
    for task in ("reverse-lines", "sort-numbers", "uppercase"):
        assert f"examples/evals/test_evals.py::test_agent[{task}]" in page
    assert page.count('data-plot="curve"') == 2 * 4  # per run: overall and per task


def test_runs_on_different_baselines_are_said_to_be_so_in_the_report(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", [line("t", s, 1.0) for s in range(3)])
    b = write(tmp_path / "b.jsonl", [line("t", s, 0.0, baseline_digest="sha256:cd") for s in range(3)])
    out = tmp_path / "r.html"
    assert results_cli(str(a), str(b), "--html", str(out)).returncode == 0
    page = out.read_text()
    assert "Different baseline digests" in page and "not like for like" in page
    assert '<span class="flag flag-worse">worse</span>' in page  # every pair lost 1.0


def test_readers_accept_schema_1_and_2_and_name_the_ones_they_read(tmp_path: Path) -> None:
    v1 = {**line("t", 0, 0.0), "v": 1, "message": "ExecError: timed out"}
    del v1["cause"]
    path = write(tmp_path / "mixed.jsonl", [v1, {**line("t", 1, 0.0), "message": "out of memory"}])
    from pytest_smolvm.evals.results.load import cause

    first, second = read(path)
    assert cause(first) == "timeout"  # v1: guessed from the message, as before
    assert cause(second) == "failed"  # v2: the line's own cause; its message is not believed
    write(path, [{**line("t", 0, 0.0), "v": 3}])
    with pytest.raises(ResultsError, match=r"schema version 3 is not one this pytest-smolvm reads \(1, 2\)"):
        read(path)


def test_a_bad_html_path_is_a_one_line_error_naming_the_option(tmp_path: Path) -> None:
    run = write(tmp_path / "a.jsonl", [line("t", 0, 1.0)])
    (tmp_path / "file").write_text("")
    done = results_cli(str(run), "--html", str(tmp_path / "file" / "r.html"))
    assert done.returncode == 2
    assert done.stderr.startswith(f"pytest-smolvm results: --html {tmp_path / 'file' / 'r.html'}: cannot write")
    assert done.stderr.strip().count("\n") == 0


def test_the_pytest_html_report_gets_the_eval_section(pytester: pytest.Pytester, smol_state: Path) -> None:
    shutil.copytree(EVALS, pytester.path / "evals")
    result = pytester.runpytest_subprocess("evals", "-p", "no:randomly", "--html=report.html",
                                           "--self-contained-html", "--smol-results=r.jsonl")
    result.assert_outcomes(passed=12)
    page = (pytester.path / "report.html").read_text()
    assert '<div class="smolvm-evals">' in page and "smolvm episodes" in page
    assert page.count('data-plot="curve"') == 4 and 'data-plot="intervals"' in page


@pytest.mark.parametrize("html", [["-p", "no:html"], []], ids=["pytest-html-off", "pytest-html-not-asked"])
def test_without_a_pytest_html_report_the_section_costs_nothing(pytester: pytest.Pytester, smol_state: Path,
                                                               html: list[str]) -> None:
    pytester.makepyfile("""
        import sys
        import pytest

        @pytest.mark.smol_episodes(2)
        def test_e(smol_episode):
            smol_episode.record(1)

        def test_zz_modules():
            loaded = sorted(m for m in sys.modules if m.startswith(("pytest_smolvm.evals.results",
                                                                    "pytest_smolvm.plugin.html_section")))
            print("\\nLOADED", loaded)
    """)
    result = pytester.runpytest_subprocess(*html, "-p", "no:randomly", "-s")
    result.assert_outcomes(passed=3)
    # pytest-html installed but not writing a report: only the few-line hook class is loaded
    result.stdout.fnmatch_lines(["LOADED []" if html else "LOADED ['pytest_smolvm.plugin.html_section']"])
