"""Guest logs, exec transcripts and collected guest files, into every report sink at once.

Sinks, for a failed test (and for every test with ``--smol-logs=always``):

- the report itself. A failure's text goes into its ``longrepr`` as a ``smolvm guest NAME``
  section: the terminal prints it with the failure, and JUnit XML writes ``str(longrepr)`` into
  ``<failure>``/``<error>`` whatever ``junit_logging`` says (report sections only reach JUnit's
  ``system-out`` under ``junit_logging=log|all``, and only with a ``Captured log`` name). A passing
  or skipped test's text has no longrepr to live in, so it becomes a ``Captured log smolvm guest
  NAME call`` section: shown with ``-rP`` and written to ``system-out`` by ``junit_logging=log|all``.
- pytest-html (``report.extras``) and allure-pytest (an attachment), when they are active;
- files under ``--smol-artifacts=DIR/<test id>/``: ``transcript.txt``, ``guest-logs.txt``, what
  ``pytest_smolvm_collect_artifacts`` returns (under ``files/``), and ``notes.txt`` for anything
  that was cut or could not be copied. The report text ends with ``[[ATTACHMENT|path]]``, the line
  GitLab and Jenkins read from JUnit output.

Report text is produced while the guests are alive (setup/call reports come before teardown);
files are written from the fixture finalizer, before destruction, so they hold the whole
transcript, including what fixtures ran in the guest after the test body.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import posixpath
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_smolvm import limits
from pytest_smolvm.inert import inert
from pytest_smolvm.plugin import xdist
from pytest_smolvm.plugin.collection import GUEST_FILES_MARK, GUEST_FILES_MARK_TEXT, guest_files_dir_name
from pytest_smolvm.untrusted import walk

if TYPE_CHECKING:
    from pytest_smolvm.session.pool import LiveGuest
    from pytest_smolvm.session.run import SmolRun

SECTION = "smolvm guest"
CAPTURED_KEY = f"log {SECTION}"  # "Captured log ..." is the prefix junit_logging=log copies


@dataclass
class _ItemState:
    guests: list[LiveGuest] = field(default_factory=list)
    failed: bool = False  # setup or call failed
    attached: bool = False  # report text already attached (once per test is enough)
    saved: bool = False  # files already written


@dataclass(frozen=True)
class SinkSettings:
    logs: str  # "failed" or "always"
    artifacts: Path | None


STATE_KEY = pytest.StashKey[_ItemState]()
SETTINGS_KEY = pytest.StashKey[SinkSettings]()


def install(config: pytest.Config, run: SmolRun) -> None:
    """From the guest fixture, before this process's first guest (the controller told workers
    the resolved directory at configure: see hooks.py)."""
    if SETTINGS_KEY in config.stash:
        return
    artifacts = run.settings.artifacts
    workerinput = xdist.worker_input(config)
    if workerinput is not None and workerinput.get(xdist.ARTIFACTS_DIR):
        artifacts = Path(workerinput[xdist.ARTIFACTS_DIR])  # the controller's view of a relative path wins
    config.stash[SETTINGS_KEY] = SinkSettings(run.settings.logs, artifacts)


def _state(item: pytest.Item) -> _ItemState:
    return item.stash.setdefault(STATE_KEY, _ItemState())


def failed_so_far(item: pytest.Item) -> bool:
    """Whether the test's setup or call failed (its reports so far)."""
    return item.stash.get(STATE_KEY, _ItemState()).failed


def branched_from(guests: list[LiveGuest]) -> dict[str, str]:
    """Each guest made by ``vm.branch`` among ``guests``, and the guest it was branched from."""
    return {live.vm.name: live.record.parent for live in guests if live.record.parent}


def finished_guests(item: pytest.Item) -> list[LiveGuest]:
    """Every guest the test had, also after they were destroyed (durations, names)."""
    return list(item.stash.get(STATE_KEY, _ItemState()).guests)


def _settings(item: pytest.Item) -> SinkSettings:
    return item.config.stash.get(SETTINGS_KEY, SinkSettings("failed", None))


# ---------------------------------------------------------------------- text


def cap_text(text: str, limit: int, where: str = "") -> str:
    """``text`` cut to about ``limit`` characters, keeping the head and (mostly) the tail.

    The tail is where a failure usually is; the head shows how the guest started.
    """
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    cut = len(text) - head - tail
    hint = f"; full text in {where}" if where else ""
    return f"{text[:head]}\n[... pytest-smolvm: {cut} characters cut here{hint} ...]\n{text[-tail:]}"


def make_report_inert(report: pytest.TestReport) -> None:
    """The report of a test that used a guest, with nothing in it that acts on a terminal.

    The second wall behind the plugin's own errors (made inert where raised, errors.py): guest
    text reaches a report by paths the plugin does not build, an assertion message quoting a
    command's output, a ``print`` in the test, an exception chained from one that quotes the
    guest. A traceback is flattened to its text only where there is something to escape in it,
    so any other keeps pytest's structure (and its colours).
    """
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        path, line, reason = longrepr
        report.longrepr = (path, line, inert(reason))
    elif longrepr is not None:
        text = str(longrepr)
        if inert(text) != text:
            report.longrepr = inert(text)
    report.sections = [(title, inert(body)) for title, body in report.sections]
    if isinstance(getattr(report, "wasxfail", None), str):
        report.wasxfail = inert(report.wasxfail)


def guest_text(live: LiveGuest) -> str:
    """The guest's logs and transcript, inert (see inert.py) for every sink; never raises (a
    broken guest must not hide the failure)."""
    try:
        return inert(live.vm.logs())
    except Exception as exc:
        return inert(f"(guest logs unavailable: {type(exc).__name__}: {exc})\n{live.vm.transcript_text()}")


def artifact_dirname(nodeid: str) -> str:
    """A file name for a test id: readable, one path component, bounded length."""
    name = re.sub(r"[^A-Za-z0-9._=-]+", "_", nodeid).strip("._") or "test"
    if len(name) > 120:  # long parametrize ids: keep them apart with a digest of the full id
        name = f"{name[:100]}-{hashlib.sha256(nodeid.encode()).hexdigest()[:12]}"
    return name


def test_dir(item: pytest.Item) -> Path | None:
    root = _settings(item).artifacts
    return None if root is None else root / artifact_dirname(item.nodeid)


def saved_dir(item: pytest.Item) -> str | None:
    """The test's artifacts directory if files were written there (a result line links to it)."""
    directory = test_dir(item)
    return str(directory.resolve()) if directory is not None and _state(item).saved else None


# ---------------------------------------------------------------------- report sinks


def report_made(item: pytest.Item, report: pytest.TestReport, guests: list[LiveGuest]) -> None:
    """From the plugin's makereport wrapper: attach guest text to ``report`` where it is due."""
    state = _state(item)
    if report.when in ("setup", "call") and report.failed:
        state.failed = True
    guests = guests or state.guests  # at teardown the finalizer has already cleared the live list
    if not guests or state.attached:
        return
    wanted = report.failed or (_settings(item).logs == "always" and report.when == "call")
    if not wanted:
        return
    state.attached = True
    if report.when == "teardown" and not state.saved:
        # Teardown failed after a clean call: the guests are gone, but their transcripts are not.
        _save_quietly(item, state.guests, collect=False)
    directory = test_dir(item)
    attachment = f"\n[[ATTACHMENT|{(directory / 'transcript.txt').resolve()}]]" if directory else ""
    html = _html_extras(item.config)
    for live in guests:
        where = str(directory / "transcript.txt") if directory else ""
        text = cap_text(guest_text(live), limits.LIMITS.report_section_chars, where) + attachment
        title = f"{SECTION} {live.vm.name}"
        addsection = getattr(report.longrepr, "addsection", None)  # pytest's ExceptionRepr
        if report.failed and callable(addsection):
            addsection(title, text)
        else:
            # Like captured output: on this report, and on the item so that the teardown report,
            # the one JUnit takes system-out from, carries it too.
            key = f"{CAPTURED_KEY} {live.vm.name}"
            item.add_report_section(report.when, key, text)
            report.sections.append((f"Captured {key} {report.when}", text))
        if html is not None:
            report.extras = [*getattr(report, "extras", []), html.text(text, name=title)]  # type: ignore[attr-defined]
        _allure_attach(item.config, title, text)


def _html_extras(config: pytest.Config) -> Any:
    if not config.pluginmanager.hasplugin("html"):
        return None
    try:  # imported by name: pytest-html is optional and untyped
        return importlib.import_module("pytest_html.extras")
    except ImportError:
        return None


def _allure_attach(config: pytest.Config, title: str, text: str) -> None:
    # allure-pytest registers its listener only when --alluredir is given.
    if not config.pluginmanager.hasplugin("allure_listener"):
        return
    try:
        allure: Any = importlib.import_module("allure")  # optional: by name, so mypy need not find it
        allure.attach(text, name=title, attachment_type=allure.attachment_type.TEXT)
    except Exception as exc:  # a report sink must not turn into a test failure
        warnings.warn(f"pytest-smolvm: allure attachment failed: {type(exc).__name__}: {exc}", stacklevel=1)


# ---------------------------------------------------------------------- files


def before_destroy(item: pytest.Item, guests: list[LiveGuest]) -> None:
    """From the fixture finalizer, with every guest still alive. Never raises."""
    state = _state(item)
    state.guests = list(guests)
    if state.failed or _settings(item).logs == "always":
        _save_quietly(item, state.guests, collect=True)


def _save_quietly(item: pytest.Item, guests: list[LiveGuest], *, collect: bool) -> None:
    try:
        save(item, guests, collect=collect)
    except Exception as exc:  # saving artifacts must never replace the test's outcome
        warnings.warn(f"pytest-smolvm: could not save artifacts for {item.nodeid}: "
                      f"{type(exc).__name__}: {exc}", stacklevel=1)


def save(item: pytest.Item, guests: list[LiveGuest], *, collect: bool) -> Path | None:
    """Write the artifacts dir for ``item``; with ``collect``, copy out the hook's guest paths."""
    directory = test_dir(item)
    state = _state(item)
    if directory is None or not guests:
        return None
    state.saved = True
    if directory.exists():  # a rerun of the same test: its dir describes the latest attempt
        walk.rmtree(directory)  # guest copies in it: any depth, no link followed
    directory.mkdir(parents=True)
    notes: list[str] = []
    transcripts, logs = [], []
    for live in guests:
        header = f"=== guest {live.vm.name} (backend {live.vm.backend}, baseline {live.vm.baseline} {live.vm.digest})"
        transcripts.append(f"{header}\n{live.vm.transcript_text()}\n")
        try:
            console = live.guest.logs() or "(this guest has no console log; the namespace backend has none)"
        except Exception as exc:
            console = f"(guest logs unavailable: {type(exc).__name__}: {exc})"
        logs.append(f"{header}\n{console.rstrip()}\n")
    _write_text(directory / "transcript.txt", inert("\n".join(transcripts)), notes)  # read with cat, in a terminal
    _write_text(directory / "guest-logs.txt", inert("\n".join(logs)), notes)
    if collect:
        # Marked before any guest file arrives: no later pytest run collects the copies.
        (directory / GUEST_FILES_MARK).write_text(GUEST_FILES_MARK_TEXT)
        budget = limits.LIMITS.artifacts_bytes
        for number, live in enumerate(guests, start=1):
            files = directory / guest_files_dir_name(number)
            for path in _hook_paths(item, live, notes):
                budget = _copy_out(live, path, files, budget, notes)
    if notes:
        (directory / "notes.txt").write_text("\n".join(notes) + "\n")
    return directory


def _write_text(path: Path, text: str, notes: list[str]) -> None:
    if len(text) > limits.LIMITS.report_file_chars:
        notes.append(f"{path.name}: {len(text)} characters, cut to {limits.LIMITS.report_file_chars} (marker inside)")
    path.write_text(cap_text(text, limits.LIMITS.report_file_chars), errors="replace")


def _hook_paths(item: pytest.Item, live: LiveGuest, notes: list[str]) -> list[str]:
    try:
        results = item.config.hook.pytest_smolvm_collect_artifacts(item=item, vm=live.vm)
    except Exception as exc:
        notes.append(f"pytest_smolvm_collect_artifacts raised {type(exc).__name__}: {exc}")
        return []
    paths: list[str] = []
    for result in results:
        for path in [result] if isinstance(result, (str, os.PathLike)) else result:
            paths.append(os.fspath(path))
    return list(dict.fromkeys(paths))  # the same path from two implementations is copied once


def _copy_out(live: LiveGuest, path: str, files: Path, budget: int, notes: list[str]) -> int:
    relative = posixpath.normpath(path).lstrip("/")
    if not path.startswith("/") or relative.startswith("..") or relative in ("", "."):
        notes.append(f"{live.vm.name}:{path}: not copied: expected an absolute guest path below /")
        return budget
    dest = files / relative
    if budget <= 0:
        notes.append(f"{live.vm.name}:{path}: not copied: "
                     f"the {limits.LIMITS.artifacts_bytes}-byte budget per test is spent")
        return budget
    try:
        # copy_out puts a copy inside an existing directory; a collected path names its copy.
        # Whatever is there came from an earlier path of this test (a parent or a child of this
        # one): once this copy has arrived beside it, a link there is removed (never followed)
        # and a tree replaced; a copy that fails leaves the earlier one as it was.
        # What is left of the budget bounds the copy while it arrives: a guest's 4 GiB tree
        # never reaches the host's disk to be measured afterwards.
        if dest.is_symlink() or dest.exists():
            fresh = dest.with_name(f".{dest.name}.smolvm-collect")
            walk.rmtree(fresh)
            try:
                live.vm.copy_out("/" + relative, fresh, max_bytes=budget)
                walk.rmtree(dest)
                os.replace(fresh, dest)
            finally:
                walk.rmtree(fresh)
        else:
            live.vm.copy_out("/" + relative, dest, max_bytes=budget)
    except Exception as exc:
        notes.append(f"{live.vm.name}:{path}: not copied ({budget} bytes were left of the "
                     f"{limits.LIMITS.artifacts_bytes}-byte budget per test): {type(exc).__name__}: {exc}")
        return budget
    size = walk.tree_bytes(dest)
    if size > budget:
        # Copied whole, then dropped: a partial tree would look complete, an absent one does not.
        walk.rmtree(dest)
        notes.append(f"{live.vm.name}:{path}: dropped: {size} bytes exceed the {budget} bytes left of the "
                     f"{limits.LIMITS.artifacts_bytes}-byte budget per test")
        return 0
    return budget - size
