"""pytest hooks and fixtures: thin glue over settings, lifecycle, registry and reporting."""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from types import FrameType
from typing import Any, NoReturn

import pytest

from pytest_smolvm import artifacts, episodes, hookspecs, progress, reporting
from pytest_smolvm.errors import ProvisionError, UsageError
from pytest_smolvm.lifecycle import LiveGuest, SmolSession
from pytest_smolvm.registry import records
from pytest_smolvm.settings import MARKERS, MarkerSpec, Settings, add_options, marker_spec
from pytest_smolvm.vm import VM
from pytest_smolvm.warm import BaselineSetup, BaselineSetupError

SESSION_KEY = pytest.StashKey[SmolSession]()
GUESTS_KEY = pytest.StashKey[list[LiveGuest]]()
REPORTS_KEY = pytest.StashKey[dict[str, pytest.TestReport]]()
SIGNALS_KEY = pytest.StashKey[dict[int, Any]]()
COUNTER_KEY = pytest.StashKey["GuestTestCounter"]()
RUN_ID_INPUT = "smolvm_run_id"
SHARED_INPUT = "smolvm_shared_state"


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    run_id = config.workerinput[RUN_ID_INPUT] if _is_worker(config) else uuid.uuid4().hex  # type: ignore[attr-defined]
    progress.install(config)  # before the session: pinning a registry baseline may pull it
    try:
        session = SmolSession(Settings.from_config(config), run_id=run_id)
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[SESSION_KEY] = session
    if _is_worker(config):
        session.adopt_shared_state(json.loads(config.workerinput.get(SHARED_INPUT, "{}")))  # type: ignore[attr-defined]
    config.stash[SIGNALS_KEY] = _signals_to_keyboard_interrupt()
    counter = GuestTestCounter()
    config.stash[COUNTER_KEY] = counter
    config.pluginmanager.register(counter, "smolvm-counter")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistController(session), "smolvm-xdist")
    episodes.install(config, session)
    artifacts.install(config, session)


def _signals_to_keyboard_interrupt() -> dict[int, Any]:
    """SIGTERM and SIGHUP take the Ctrl-C path, so every finalizer runs."""
    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, interrupt)
        except ValueError:  # not the main thread: leave signals to whoever owns it
            break
    return previous


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is not None:
        session.close()
    progress.reset()
    for sig, handler in config.stash.get(SIGNALS_KEY, {}).items():
        signal.signal(sig, handler)


class GuestTestCounter:
    """Counts tests that used a guest, from xdist workers' reports too (the controller sees them)."""

    def __init__(self) -> None:
        self.count = 0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and any(k == "smolvm_backend" for k, _ in report.user_properties):
            self.count += 1


class XdistController:
    """Hooks that exist only when pytest-xdist is installed (registered on demand)."""

    def __init__(self, session: SmolSession) -> None:
        self.session = session

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[RUN_ID_INPUT] = self.session.run_id
        node.workerinput[SHARED_INPUT] = json.dumps(self.session.shared_state())

    def pytest_testnodedown(self, node: Any, error: object) -> None:
        if error:
            self.session.reap()  # the dead worker's guests died with it; this clears what they left


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_worker(session.config):
        session.config.stash[SESSION_KEY].reap()  # what dead runs left behind


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    smol = session.config.stash.get(SESSION_KEY, None)
    if smol is not None:
        smol.close()
        if not _is_worker(session.config):
            smol.reap()


def pytest_report_header(config: pytest.Config) -> list[str]:
    return reporting.header_lines(config.stash[SESSION_KEY])


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if _is_worker(config):
        return
    session = config.stash[SESSION_KEY]
    kept = [r for r in records() if r.kept and r.run_id == session.run_id]
    lines = reporting.summary_lines(session, kept, used_guests=config.stash[COUNTER_KEY].count > 0)
    if lines:
        terminalreporter.section("smolvm")
        for line in lines:
            terminalreporter.line(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
        None, pytest.TestReport, pytest.TestReport]:
    report = yield
    item.stash.setdefault(REPORTS_KEY, {})[report.when] = report
    guests = item.stash.get(GUESTS_KEY, [])
    artifacts.report_made(item, report, guests)  # guest logs into every sink, when due
    return report


def _test_failed(item: pytest.Item) -> bool:
    return any(r.failed for r in item.stash.get(REPORTS_KEY, {}).values())


def _fail_setup(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


@pytest.fixture
def smol_vm_factory(request: pytest.FixtureRequest,
                    smol_baseline_setup: Sequence[str]) -> Iterator[Callable[..., VM]]:
    """Make guests on demand: ``smol_vm_factory(**marker_keywords)``; all destroyed at teardown."""
    item = request.node
    session = request.config.stash[SESSION_KEY]
    try:
        setup: BaselineSetup | None = BaselineSetup.from_config(request.config, smol_baseline_setup)
        base_spec: MarkerSpec | None = marker_spec(item)
        problem = ""
    except UsageError as exc:
        setup, base_spec, problem = None, None, str(exc)
    if setup is None or base_spec is None:
        _fail_setup(problem)  # outside the except block: no chained traceback in the report
    assert base_spec is not None
    made: list[LiveGuest] = item.stash.setdefault(GUESTS_KEY, [])

    def make(**keywords: Any) -> VM:
        try:
            spec = base_spec.merged(keywords, "smol_vm_factory")
            proposed = {k: getattr(spec, k) for k in MarkerSpec.__dataclass_fields__}
            item.config.hook.pytest_smolvm_configure_vm(item=item, spec=proposed)
            spec = MarkerSpec().merged(proposed, "pytest_smolvm_configure_vm")
            live: LiveGuest | None = session.create(item.nodeid, spec, setup)
            problem = ""
        except UsageError as exc:
            live, problem = None, str(exc)
        except BaselineSetupError as exc:
            # Stop the run (xdist included) rather than fail every remaining test the same way.
            request.session.shouldstop = "pytest-smolvm: the baseline setup failed (its output is above)"
            live, problem = None, f"pytest-smolvm: the baseline setup failed: {exc}"
        except ProvisionError as exc:
            live, problem = None, f"pytest-smolvm: could not provision a guest (infrastructure, not the test): {exc}"
        if live is None:
            _fail_setup(problem)
        assert live is not None
        if not made:  # on the item, so every later report (and JUnit XML) carries them
            item.user_properties += [("smolvm_backend", live.vm.backend),
                                     ("smolvm_baseline", live.vm.baseline),
                                     ("smolvm_baseline_digest", live.vm.digest)]
        made.append(live)
        item.config.hook.pytest_smolvm_vm_ready(item=item, vm=live.vm)
        return live.vm

    try:
        yield make
    finally:
        keep = session.settings.keep
        artifacts.before_destroy(item, made)  # files to save need the guests alive
        for live in reversed(made):
            if keep == "always" or (keep == "failed" and _test_failed(item)):
                session.keep(live)
            else:
                session.destroy(live)
        made.clear()


@pytest.fixture(scope="session")
def smol_baseline_setup() -> Sequence[str]:
    """Shell commands that make the warm baseline, run once per host before any guest forks.

    Override it in a conftest.py (keep it session-scoped) to return your setup commands; the
    ``pytest_smolvm_prepare_baseline`` hook is the same thing for code that needs the VM handle.
    """
    return ()


@pytest.fixture
def smol_vm(smol_vm_factory: Callable[..., VM]) -> VM:
    """A fresh guest for this test (and so for each parametrized case), destroyed afterwards."""
    return smol_vm_factory()

