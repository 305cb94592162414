"""A failed test's guest logs and transcript reach every sink: terminal, JUnit XML, pytest-html,
allure, and the --smol-artifacts dir (with the files pytest_smolvm_collect_artifacts names)."""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import threading
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, cast

import pytest

from pytest_smolvm.backends.base import GuestExecResult
from pytest_smolvm.handle.base import GuestHandle
from pytest_smolvm.plugin.artifacts import artifact_dirname, cap_text

FAILING = """
    def test_fail(smol_vm):
        smol_vm.exec("mkdir -p /workspace/out && echo 'partial answer' > /workspace/out/answer.txt")
        smol_vm.exec("echo transcript-marker-7f3a; echo on-stderr >&2; exit 3")
        assert False, "reward was 0"

    def test_pass(smol_vm):
        smol_vm.exec("echo passing-marker-91c2")
"""
CONFTEST = """
    def pytest_smolvm_collect_artifacts(item, vm):
        return ["/workspace/out", "/does/not/exist"]
"""
FAIL_DIR = "test_*.py_test_fail"


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_unit_cap_text_and_dirnames() -> None:
    assert cap_text("short", 100) == "short"
    capped = cap_text("a" * 50 + "b" * 1000, 100, "/x/transcript.txt")
    assert "[... pytest-smolvm: 950 characters cut here; full text in /x/transcript.txt ...]" in capped
    assert capped.startswith("a" * 25) and capped.endswith("b" * 75)
    assert artifact_dirname("tests/test_a.py::test_x[task-ep0]") == "tests_test_a.py_test_x_task-ep0"
    long = artifact_dirname("t.py::test[" + "x" * 300 + "]")
    assert len(long) == 113 and long != artifact_dirname("t.py::test[" + "x" * 299 + "y]")


def test_unit_an_exec_is_in_the_transcript_from_the_moment_it_is_sent() -> None:
    class Guest:
        name = "fake"

        def __init__(self) -> None:
            self.sent, self.release = threading.Event(), threading.Event()

        def exec(self, argv: list[str], **_: object) -> GuestExecResult:
            if argv[-1] == "interrupt":
                raise KeyboardInterrupt
            self.sent.set()
            self.release.wait(10)
            return GuestExecResult(0, b"done\n", b"")

    guest = Guest()
    vm = GuestHandle(cast("Any", guest))
    with pytest.raises(KeyboardInterrupt):
        vm.exec("interrupt")
    assert re.fullmatch(r"\$ interrupt    \[INTERRUPTED by KeyboardInterrupt, [\d.]+s\]", vm.transcript_text())
    waiting = threading.Thread(target=vm.exec, args=("wait",))
    waiting.start()
    assert guest.sent.wait(10)
    assert re.search(r"^\$ wait    \[still running, [\d.]+s so far\]$", vm.transcript_text(), re.MULTILINE)
    guest.release.set()
    waiting.join(10)
    assert re.search(r"^\$ wait    \[exit 0, [\d.]+s\]\n  --- stdout \(tail\)\n  done$", vm.transcript_text(),
                     re.MULTILINE)


def test_failed_test_transcript_in_every_sink(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(FAILING)
    pytester.makeconftest(CONFTEST)
    args = ["-p", "no:randomly", "--junitxml=junit.xml", "--smol-artifacts=art"]
    if _has_module("pytest_html"):
        args += ["--html=report.html", "--self-contained-html"]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(failed=1, passed=1)
    out = result.stdout.str()

    # Terminal: a section under the failure, ending with where the files are.
    result.stdout.fnmatch_lines([
        "*- smolvm guest smol-*-main-1 -*",
        "$ echo transcript-marker-7f3a; echo on-stderr >&2; exit 3    [[]exit 3, *s[]]",
        "  --- stdout (tail)",
        "  transcript-marker-7f3a",
        "  --- stderr (tail)",
        "  on-stderr",
        "[[]*ATTACHMENT|*/art/test_failed_test_transcript_in_every_sink.py_test_fail/transcript.txt[]]*",
    ])
    assert "passing-marker-91c2" not in out  # passing tests stay quiet by default

    # JUnit: in the <failure> body, whatever junit_logging says (default "no").
    tree = ET.parse(pytester.path / "junit.xml")
    failure = tree.find(".//testcase[@name='test_fail']/failure")
    assert failure is not None and failure.text is not None
    assert "transcript-marker-7f3a" in failure.text and "[[ATTACHMENT|" in failure.text
    assert "passing-marker-91c2" not in (pytester.path / "junit.xml").read_text()

    # Artifacts: transcript, guest logs, the hook's files, and a note for what could not be copied.
    (test_dir,) = (pytester.path / "art").glob(FAIL_DIR)
    assert sorted(p.name for p in test_dir.iterdir()) == [".smolvm-guest-files", "files", "guest-logs.txt", "notes.txt",
                                                          "transcript.txt"]
    transcript = (test_dir / "transcript.txt").read_text()
    assert "transcript-marker-7f3a" in transcript and "=== guest smol-" in transcript
    assert (test_dir / "files" / "workspace" / "out" / "answer.txt").read_text() == "partial answer\n"
    assert "/does/not/exist: not copied" in (test_dir / "notes.txt").read_text()
    assert [p.name for p in (pytester.path / "art").iterdir()] == [test_dir.name]  # not for the passing test

    if _has_module("pytest_html"):
        html = (pytester.path / "report.html").read_text()
        encoded = re.findall(r"data:text/plain;charset=utf-8;base64,([A-Za-z0-9+/=]+)", html)
        blobs = [base64.b64decode(blob).decode() for blob in encoded]
        assert any("transcript-marker-7f3a" in b for b in blobs), "no smolvm extra in the HTML report"


def test_logs_always_covers_passing_tests(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(FAILING)
    pytester.makeini("[pytest]\nsmol_logs = always\njunit_logging = log\n")
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-rP", "--junitxml=junit.xml",
                                           "--smol-artifacts=art")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*- Captured log smolvm guest smol-*-main-2 call -*", "  passing-marker-91c2"])
    tree = ET.parse(pytester.path / "junit.xml")
    system_out = tree.find(".//testcase[@name='test_pass']/system-out")
    assert system_out is not None and "passing-marker-91c2" in (system_out.text or "")
    assert len(list((pytester.path / "art").iterdir())) == 2


def test_bad_logs_value_is_a_usage_error(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("def test_x(): pass\n")
    result = pytester.runpytest_subprocess("--smol-logs=sometimes")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --smol-logs=sometimes: choose one of failed, always"])


def test_teardown_failure_after_a_clean_call_gets_the_transcript(pytester: pytest.Pytester,
                                                                  smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.fixture
        def checked(smol_vm):
            yield smol_vm
            smol_vm.exec("echo checking-after-test-5d1e")
            raise RuntimeError("post-test check failed")

        def test_ok(checked):
            checked.exec("echo in-test")
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-artifacts=art", "--junitxml=j.xml")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*- smolvm guest smol-*-main-1 -*", "$ echo checking-after-test-5d1e*"])
    (test_dir,) = (pytester.path / "art").iterdir()
    assert "checking-after-test-5d1e" in (test_dir / "transcript.txt").read_text()
    assert "checking-after-test-5d1e" in (pytester.path / "j.xml").read_text()


def test_size_caps_leave_a_visible_marker(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makeconftest("""
        import dataclasses
        from pytest_smolvm import limits

        limits.LIMITS = dataclasses.replace(limits.LIMITS, report_section_chars=3000, artifacts_bytes=10_000)

        def pytest_smolvm_collect_artifacts(item, vm):
            return ["/small", "/big"]
    """)
    pytester.makepyfile("""
        def test_big(smol_vm):
            smol_vm.exec("head -c 2000 /dev/zero > /small; head -c 50000 /dev/zero > /big")
            for i in range(10):
                smol_vm.exec(f"echo command-{i}; head -c 1500 /dev/zero | tr '\\\\0' x")
            assert False
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-artifacts=art")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]... pytest-smolvm: * characters cut here; full text in *transcript.txt ...[]]*"])
    (test_dir,) = (pytester.path / "art").iterdir()
    assert "command-0" in (test_dir / "transcript.txt").read_text()  # the file has it all
    assert (test_dir / "files" / "small").stat().st_size == 2000
    assert not (test_dir / "files" / "big").exists()
    # Refused while it arrived, at what was left of the budget: never copied whole, then measured.
    notes = (test_dir / "notes.txt").read_text()
    assert "/big: not copied (8000 bytes were left of the 10000-byte budget per test)" in notes, notes
    assert "more than 8000 bytes" in notes, notes


def test_a_collected_tree_deeper_than_pythons_recursion_limit_is_measured_and_dropped(
        pytester: pytest.Pytester, smol_state: Path) -> None:
    # 1,200 nested directories hold 100 bytes of data, within the copy's byte cap; their own sizes
    # then put the copy over the budget. Measuring and removing it must not recurse per level:
    # a RecursionError left the whole tree on the host and the test's artifacts unsaved.
    pytester.makeconftest("""
        import dataclasses
        from pytest_smolvm import limits

        limits.LIMITS = dataclasses.replace(limits.LIMITS, artifacts_bytes=10_000)

        def pytest_smolvm_collect_artifacts(item, vm):
            return ["/deep"]
    """)
    pytester.makepyfile("""
        def test_deep(smol_vm):
            r = smol_vm.exec("d=/deep/$(printf 'd/%.0s' $(seq 1200)); mkdir -p $d && head -c 100 /dev/zero > $d/f")
            assert r.exit_code == 0, r.stderr
            assert False
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-artifacts=art")
    result.assert_outcomes(failed=1)
    (test_dir,) = (pytester.path / "art").iterdir()
    notes = (test_dir / "notes.txt").read_text()
    assert "/deep: dropped:" in notes and "exceed the" in notes, notes
    assert not (test_dir / "files" / "deep").exists()
    assert "could not save artifacts" not in result.stdout.str()


def test_a_rerun_replaces_its_artifacts_under_an_artifacts_dir_that_is_a_link(
        pytester: pytest.Pytester, smol_state: Path) -> None:
    # The dir the user names may be a link (to a bigger disk, say): it is theirs, resolved as a
    # path; only what lies under it is walked by fd.
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(FAILING)
    (pytester.path / "real").mkdir()
    (pytester.path / "art").symlink_to("real")
    for _ in range(2):
        result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-artifacts=art")
        result.assert_outcomes(failed=1, passed=1)
        assert "could not save artifacts" not in result.stdout.str(), result.stdout.str()
    (test_dir,) = (pytester.path / "real").iterdir()
    assert (test_dir / "files" / "workspace" / "out" / "answer.txt").read_text() == "partial answer\n"


@pytest.mark.skipif(not _has_module("allure_pytest"), reason="allure-pytest is not installed")
def test_allure_gets_an_attachment(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(FAILING)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--alluredir=allure")
    result.assert_outcomes(failed=1, passed=1)
    results = [json.loads(p.read_text()) for p in (pytester.path / "allure").glob("*-result.json")]
    (failed,) = [r for r in results if r["name"] == "test_fail"]
    names = {a["name"]: a["source"] for a in failed.get("attachments", [])}
    sources = [src for name, src in names.items() if name.startswith("smolvm guest smol-")]
    assert sources, failed
    assert "transcript-marker-7f3a" in (pytester.path / "allure" / sources[0]).read_text()


def test_a_cut_stream_is_pure_data_and_every_sink_says_it_was_cut(pytester: pytest.Pytester,
                                                                   smol_state: Path) -> None:
    pytester.makepyfile("""
        import json
        import pytest

        @pytest.mark.smol(output_limit=1024)
        def test_cut(smol_vm):
            r = smol_vm.exec("i=0; while [ $i -lt 500 ]; do printf '%09d\\\\n' $i; i=$((i+1)); done")
            # 5,000 bytes written, 1,024 kept: the first 512 and the last 512, and nothing of ours.
            lines = [f"{i:09d}\\n" for i in range(500)]
            written = "".join(lines)
            assert r.stdout == written[:512] + written[-512:] and r.truncated == ("stdout",)
            assert "pytest-smolvm" not in r.stdout
            open("pure", "w").close()
            assert False, "show the transcript"
    """)
    result = pytester.runpytest_subprocess("--junitxml=junit.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*--- stdout (tail; the stream was cut at the output limit: its middle is not kept)*"])
    assert (pytester.path / "pure").exists(), result.stdout.str()
    assert "the stream was cut at the output limit" in (pytester.path / "junit.xml").read_text()


def test_a_command_interrupted_by_pytest_timeout_is_in_the_transcript(pytester: pytest.Pytester,
                                                                        smol_state: Path) -> None:
    # pytest-timeout's signal raises Failed inside the exec's wait: the command never returns, yet
    # every sink shows it, with what interrupted it; an aio exec is cancelled as its loop closes.
    pytester.makepyfile("""
        def test_sleep(smol_vm):
            smol_vm.exec("echo first-4b1e")
            smol_vm.exec("sleep 30 # interrupted-9c0d")

        def test_only_sleep(smol_vm):
            smol_vm.exec("sleep 31 # alone-2f7a")

        async def test_aio_sleep(smol_vm):
            await smol_vm.aio.exec("sleep 32 # aio-6e3b")
    """)
    # func_only: only the test body is timed (a guest's setup on a loaded host may take 2 s itself).
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-backend=namespace", "--timeout=2",
                                           "--timeout-method=signal", "-o", "timeout_func_only=true",
                                           "--smol-artifacts=art", "--junitxml=x.xml")
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert "(no commands were run in this guest)" not in out
    result.stdout.fnmatch_lines(["$ echo first-4b1e    [[]exit 0, *s[]]",
                                 "$ sleep 30 # interrupted-9c0d    [[]INTERRUPTED by Failed: Timeout*, *s[]]"])
    result.stdout.fnmatch_lines(["$ sleep 31 # alone-2f7a    [[]INTERRUPTED by Failed: Timeout*, *s[]]"])
    # The aio exec: still running when the test failed, or already cancelled by the loop's close.
    result.stdout.fnmatch_lines(["$ sleep 32 # aio-6e3b    [[]*s*[]]"])
    junit = (pytester.path / "x.xml").read_text()
    assert "interrupted-9c0d    [INTERRUPTED by Failed: Timeout" in junit and "alone-2f7a" in junit
    assert "aio-6e3b" in junit
    transcripts = {p.parent.name.rsplit("_test_", 1)[-1]: p.read_text()
                   for p in (pytester.path / "art").glob("*/transcript.txt")}
    assert sorted(transcripts) == ["aio_sleep", "only_sleep", "sleep"], transcripts
    assert "first-4b1e" in transcripts["sleep"] and "interrupted-9c0d    [INTERRUPTED by" in transcripts["sleep"]
    assert "alone-2f7a    [INTERRUPTED by" in transcripts["only_sleep"]
    assert "(no commands were run" not in "".join(transcripts.values())
    assert re.search(r"aio-6e3b    \[(still running, [\d.]+s so far|CANCELLED, exit \d+, [\d.]+s)\]",
                     transcripts["aio_sleep"]), transcripts["aio_sleep"]
