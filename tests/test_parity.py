"""A test's report is the same whatever schedules it: serially, at --smol-concurrency, under -n.

The corpus (tests/parity/corpus.py) has every pytest outcome in guest tests: pass, assertion
failure, skip/fail/xfail/importorskip from inside, skipif, strict xfail, xpass, setup and
teardown errors, warnings, stdout/stderr, caplog and capsys, parametrize and record_property,
the test's own TimeoutError, pytest-timeout on setup, on the body and with func_only. Each mode
records every report the terminal would read (in xdist's controller, as relayed), and every
report of every mode must equal the serial run's, field by field.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.leaks import assert_host_clean

CORPUS = Path(__file__).parent / "parity" / "corpus.py"

RECORDER = """
    import json, os, re

    IN_WORKER = []

    def pytest_configure(config):
        if hasattr(config, "workerinput"):
            IN_WORKER.append(True)  # xdist's controller records what its workers relay

    def _longrepr(report):
        longrepr = report.longrepr
        if longrepr is None:
            return None, None
        if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
            return "tuple", longrepr[2]
        crash = getattr(longrepr, "reprcrash", None)
        return type(longrepr).__name__, crash.message if crash is not None else str(longrepr).splitlines()[-1]

    def pytest_runtest_logreport(report):
        if IN_WORKER:
            return
        kind, message = _longrepr(report)
        line = {
            "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "longrepr": kind, "message": message, "wasxfail": getattr(report, "wasxfail", None),
            "user_properties": [list(p) for p in report.user_properties],
            "sections": [[title, text] for title, text in report.sections if "smolvm" not in title],
            "duration": report.duration, "stop_after_start": report.stop >= report.start,
        }
        with open(os.environ["PARITY_REPORTS"], "a") as out:
            out.write(json.dumps(line) + "\\n")

    def pytest_warning_recorded(warning_message, when, nodeid, location):
        if nodeid and not IN_WORKER:
            with open(os.environ["PARITY_REPORTS"], "a") as out:
                out.write(json.dumps({"nodeid": nodeid, "when": "warning",
                                      "warning": [warning_message.category.__name__,
                                                  re.sub(" at 0x[0-9a-f]+", " at 0x?", str(warning_message.message)),
                                                  warning_message.lineno,
                                                  warning_message.source is not None]}) + "\\n")
"""

MODES = {
    "serial": [],
    "concurrent": ["--smol-concurrency=4"],
    "xdist-concurrent": ["-n", "2", "--smol-concurrency=4"],
}


def _reports(pytester: pytest.Pytester, mode: str, monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], Any]:
    path = pytester.path / f"reports-{mode}.jsonl"
    monkeypatch.setenv("PARITY_REPORTS", str(path))
    # with the plugins the run has (pytest-randomly, pytest-asyncio's strict mode in nox's newest cell)
    html = [f"--html=report-{mode}.html"] if importlib.util.find_spec("pytest_html") else []
    # The backend named: with auto, the first guest's setup (whichever test pytest-randomly put
    # first) also probes for a microVM, seconds on a loaded host, and a 1 s or 3 s timeout test
    # drawn first then ran out in its setup in one mode only (the probe is cached after it)
    result = pytester.runpytest_subprocess(*MODES[mode], "--smol-backend=namespace", "-p", "no:anyio",
                                           "-p", "no:cacheprovider", *html)
    assert "INTERNALERROR" not in result.stdout.str(), result.stdout.str()
    if mode != "xdist-concurrent":  # capsys.disabled()'s output reaches the terminal (a worker's is not relayed)
        for line in ("PARITY-TERMINAL before an await", "PARITY-TERMINAL after an await"):
            assert result.stdout.str().count(line) == 1, f"{mode}: {line!r} on the terminal once"
    found: dict[tuple[str, str], Any] = {}
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        key = (line.pop("nodeid"), line.pop("when"))
        if key[1] == "warning":
            found.setdefault(key, []).append(line["warning"])
        else:
            assert key not in found, f"{mode}: {key} reported twice"
            found[key] = line
    return found


def _comparable(line: Any) -> Any:
    if isinstance(line, list):
        return sorted(line)
    # The threads differ by mode; the dump is there in each. Its "+ Timeout +" title is written only
    # where threading.enumerate() has more than one thread, and execnet's are not in it: under -n a
    # dump may have its stacks alone.
    sections = [[title, "<pytest-timeout's dump of the threads' stacks>" if _is_stack_dump(text) else text]
                for title, text in line["sections"]]
    return {**{k: v for k, v in line.items() if k != "duration"}, "sections": sections}


def _is_stack_dump(text: str) -> bool:
    return "+ Timeout +" in text or "~ Stack of " in text  # pytest_timeout.dump_stacks, titled or not


def test_every_report_is_the_serial_ones(pytester: pytest.Pytester, smol_state: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeconftest(RECORDER)
    pytester.makepyfile(test_corpus=CORPUS.read_text())
    runs = {mode: _reports(pytester, mode, monkeypatch) for mode in MODES}
    serial = runs["serial"]
    assert len({nodeid for nodeid, _ in serial}) == 32
    for mode, reports in runs.items():
        assert reports.keys() == serial.keys(), f"{mode}: reports made {sorted(reports.keys() ^ serial.keys())}"
        differ = {key: (reports[key], line) for key, line in serial.items()
                  if _comparable(reports[key]) != _comparable(line)}
        assert not differ, f"{mode}: (its report, the serial one) for each that differs: {differ}"
        body = reports[("test_corpus.py::test_duration_is_the_bodys", "call")]
        assert 0.3 <= body["duration"] < 5, f"{mode}: the call's duration is the body's"
    assert_host_clean(smol_state)
