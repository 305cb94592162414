"""pytest hooks and fixtures: thin glue over the run (plan, pool), reporting and the sinks.

Nothing here does work at startup: ``pytest_configure`` reads options and registers hooks.
The run's plan is made, and this process's guest pool started, when a test first asks for a
guest (see ``run.py``). A project without guest tests pays for option parsing and nothing else:
the episodes, artifacts and concurrency parts are imported, and registered, only when first
due (and no module of the package goes through pytest's assertion rewriter: see ``__init__``).
"""

from __future__ import annotations

import inspect
import sys
import time
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from pytest_smolvm.errors import BaselineSetupError, MarkerError, ProvisionError, SmolVMWarning, UsageError
from pytest_smolvm.host import progress
from pytest_smolvm.plugin import hookspecs, xdist
from pytest_smolvm.plugin.collection import guest_tree_homes, is_guest_tree, marker_problems
from pytest_smolvm.session.run import SmolRun
from pytest_smolvm.session.settings import MARKERS, MarkerSpec, Settings, add_options, marker_spec

if TYPE_CHECKING:
    from pytest_smolvm.evals.episodes import Episode, EpisodesPlugin
    from pytest_smolvm.handle.vm import VM
    from pytest_smolvm.session.pool import LiveGuest

RUN_KEY = pytest.StashKey[SmolRun]()
GUESTS_KEY = pytest.StashKey[list["LiveGuest"]]()
PROBLEMS_KEY = pytest.StashKey[list[str]]()
DECISION_KEY = pytest.StashKey[float]()  # seconds this test's setup waited for the run's one decision
WORK_KEY = pytest.StashKey[list[str]]()
GUEST_TREE_HOMES_KEY = pytest.StashKey[frozenset[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    try:
        settings = Settings.from_config(config)
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    workerinput = xdist.worker_input(config)
    if workerinput is not None:
        run = SmolRun(settings, run_id=workerinput[xdist.RUN_ID], worker=workerinput["workerid"],
                      service_address=workerinput[xdist.PLAN_SERVICE], workers=int(workerinput.get("workercount", 1)))
    else:
        distributed = bool(getattr(config.option, "numprocesses", None))  # -n N: we are xdist's controller
        run = SmolRun(settings, worker="controller" if distributed else "main")
    if settings.concurrency > 1:  # before a test runs: a pytest that moved an internal is one line
        from pytest_smolvm.plugin import internals

        internals.verify(config)
    progress.install(config)  # pulling or unpacking a baseline says how far it got
    config.stash[RUN_KEY] = run
    config.stash[PROBLEMS_KEY] = []
    config.stash[WORK_KEY] = []
    glue = xdist.controller(config)
    if glue is not None:
        glue.tell_workers(xdist.RUN_ID, lambda: run.run_id)
        glue.tell_workers(xdist.PLAN_SERVICE, run.service_address)
        glue.on_worker_down(lambda worker, crashed: _after_worker(run, glue, worker, crashed))
        glue.worker_slots = settings.concurrency
        glue.all_concurrent = run.workers_all_concurrent
        config.pluginmanager.register(_FirstTest(config, run), "smolvm-first-test")
        config.stash[PROBLEMS_KEY] = glue.problems
        config.stash[WORK_KEY] = glue.work
        if settings.artifacts is not None:
            resolved = str(settings.artifacts.resolve())  # a relative path means the same dir to every worker
            glue.tell_workers(xdist.ARTIFACTS_DIR, lambda: resolved)
    if settings.results is not None:  # result lines were asked for: their writer is due from the start
        episodes_plugin(config)
    if workerinput is None and hasattr(config.hook, "pytest_html_results_summary"):  # pytest-html installed
        from pytest_smolvm.plugin.html_section import HtmlSection

        config.pluginmanager.register(HtmlSection(config), "smolvm-html-section")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    homes = config.stash.get(GUEST_TREE_HOMES_KEY, None)
    if homes is None:
        homes = config.stash[GUEST_TREE_HOMES_KEY] = guest_tree_homes(
            config.stash[RUN_KEY].settings.artifacts if RUN_KEY in config.stash else None)
    return True if is_guest_tree(collection_path, homes) else None  # None: pytest's other rules decide


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, pytest.CollectReport,
                                                                          pytest.CollectReport]:
    report = yield
    problems = marker_problems(report.result) if report.passed else []
    if problems:  # a collection error of the module, as pytest's own for an unknown marker
        report.outcome, report.longrepr, report.result = "failed", "\n".join(problems), []
    return report


def _after_worker(run: SmolRun, controller: xdist.Controller, worker: str | None, crashed: bool) -> None:
    if crashed and run.plan is not None:
        from pytest_smolvm.session.reaper import guests_by_test, reap_orphans

        if worker is not None:  # the crashed tests' results lines name the guests they had
            run.crashed_guests.update(controller.lost_guests(worker, guests_by_test(run.run_id, worker)))
        reap_orphans()  # the dead worker's guests died with it; this clears what they left


def episodes_plugin(config: pytest.Config) -> EpisodesPlugin:
    """The results and episodes plugin, registered when first due: ``--smol-results``, a
    ``smol_episodes`` marker, the ``smol_episode`` fixture, or (in xdist's controller) the first
    result line a worker sends."""
    found: EpisodesPlugin | None = config.pluginmanager.get_plugin("smolvm-episodes")
    if found is None:
        from pytest_smolvm.evals import episodes
        from pytest_smolvm.evals.glue import PluginGlue
        from pytest_smolvm.plugin import artifacts

        def tell_workers(config: pytest.Config, key: str, value: Callable[[], str]) -> None:
            controller = xdist.controller(config)
            if controller is not None:
                controller.tell_workers(key, value)

        found = episodes.install(config, config.stash[RUN_KEY], PluginGlue(
            xdist.worker_input, tell_workers, xdist.RESULTS_PATH, xdist.RESULT_ATTR,
            artifacts.finished_guests, artifacts.saved_dir))
    return found


@pytest.hookimpl(trylast=True)  # after ordinary parametrize, so ids read "task-ep0"
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("smol_episodes") is not None:
        episodes_plugin(metafunc.config)
        from pytest_smolvm.evals import episodes

        episodes.parametrize(metafunc)


@pytest.hookimpl(tryfirst=True)  # in a worker, before xdist's own hook hands the controller the collection
def pytest_collection_finish(session: pytest.Session) -> None:
    # Only an ``async def`` guest test can run concurrently; a suite without one never loads the runner.
    coroutines = [item for item in session.items if inspect.iscoroutinefunction(getattr(item, "obj", None))]
    if coroutines:
        from pytest_smolvm.plugin.async_tests import GUEST_FIXTURES

        if all(GUEST_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())) for item in coroutines):
            return
        from pytest_smolvm.plugin import concurrency

        run = session.config.stash[RUN_KEY]
        runner = concurrency.ConcurrentRunner(session.config, run, run.settings.concurrency)
        session.config.pluginmanager.register(runner, "smolvm-concurrency")
        if run.is_worker and len(coroutines) == len(session.items):
            xdist.say_if_all_concurrent(run, runner.takes, session.items)


class _FirstTest:
    """The xdist controller runs no test itself: its signals are routed once a worker's test starts."""

    def __init__(self, config: pytest.Config, run: SmolRun) -> None:
        self.config = config
        self.run = run

    def pytest_runtest_logstart(self) -> None:
        if self.run.plan is not None:
            self.run.install_signals()  # guests exist now: SIGTERM/SIGHUP must reach sessionfinish

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # The first tests start before any worker has asked for the plan; their setup reports
        # come after it: without this, a SIGTERM during the first tests killed the controller
        # outright (exit -15, nothing reaped).
        if self.run.plan is not None:
            self.run.install_signals()
        # A worker's result line (or xdist's report of a test whose worker died) is the first the
        # controller hears of episodes: their summary needs the plugin from this report on.
        registered = self.config.pluginmanager.has_plugin("smolvm-episodes")
        if not registered and (hasattr(report, xdist.RESULT_ATTR) or str(report.when) == "???"):
            episodes_plugin(self.config).pytest_runtest_logreport(report)  # registered after this call began


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    run = config.stash.get(RUN_KEY, None)
    if run is None:
        return
    problems = config.stash[PROBLEMS_KEY]
    problems += run.finish()
    if xdist.is_worker(config):
        xdist.report_to_controller(config, problems, progress.finished(), _admission_peaks())


def pytest_unconfigure(config: pytest.Config) -> None:
    run = config.stash.get(RUN_KEY, None)
    if run is not None:
        run.close()  # idempotent; covers a session that never reached sessionfinish
    progress.reset()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    run = config.stash[RUN_KEY]
    if run.is_worker or run.plan is None:
        # No guest was ever asked for: nothing to say. Once one was, the plan is said even if no
        # guest was made (a failed provision is when its backend and baseline matter most).
        return
    from pytest_smolvm.host.registry import records
    from pytest_smolvm.plugin import reporting

    kept = [r for r in records() if r.kept and r.run_id == run.run_id]
    problems: list[str] = config.stash[PROBLEMS_KEY]
    work = list(dict.fromkeys([*progress.finished(), *config.stash[WORK_KEY]]))
    lines = reporting.summary_lines(run.plan, kept, problems=problems, work=work)
    found = xdist.controller(config)
    lines += reporting.admission_lines(_admission_peaks(), *(found.admission if found is not None else []))
    if lines:
        terminalreporter.section("smolvm")
        for line in lines:
            terminalreporter.line(line)


def _admission_peaks() -> dict[str, list[int]]:
    admission = sys.modules.get("pytest_smolvm.session.admission")  # loaded with the pool, if at all
    return admission.peaks() if admission is not None else {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
        None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "setup" and DECISION_KEY in item.stash:
        # The probe boot and the baseline's preparation are the run's, whichever test came first:
        # counted in the test's duration they would skew --durations, JUnit and the results.
        report.duration = max(0.0, report.duration - item.stash[DECISION_KEY])
    guests = item.stash.get(GUESTS_KEY, None)
    if guests is not None:  # the test asked for a guest
        from pytest_smolvm.plugin import artifacts

        if report.when == "setup" and guests and xdist.is_worker(item.config):  # for the line of a crash
            setattr(report, xdist.GUESTS_ATTR, [live.vm.name for live in guests])

        artifacts.report_made(item, report, guests)  # guest logs into every sink, when due
        artifacts.make_report_inert(report)
    return report


def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None  # the common case, decided without importing asyncio
    from pytest_smolvm.plugin import async_tests

    return async_tests.run(pyfuncitem)


def _fail_setup(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


@pytest.fixture
def smol_vm_factory(request: pytest.FixtureRequest,
                    smol_baseline_setup: Sequence[str]) -> Iterator[Callable[..., VM]]:
    """Make guests on demand: smol_vm_factory(**marker_keywords); all destroyed at teardown."""
    from pytest_smolvm.plugin import artifacts, premade
    from pytest_smolvm.session import branching
    from pytest_smolvm.session.warm import BaselineSetup

    item = request.node
    run = request.config.stash[RUN_KEY]
    artifacts.install(request.config, run)
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

    item.stash[premade.SETUP_KEY] = setup  # the concurrent runner makes the next tests' guests with it

    def make(**keywords: Any) -> VM:
        max_vms = run.settings.max_vms
        held = sum(1 for live in made if live.vm.name in run.pool.live) if max_vms and made else 0
        if max_vms and held >= max_vms:  # no slot can come free while this test holds them all
            _fail_setup(f"smol_vm_factory: this test already holds {held} guest{'s' if held > 1 else ''}, "
                        f"as many as --smol-max-vms={max_vms} lets live at once: one more would wait for ever")
        try:
            live: LiveGuest | None = premade.take(item, keywords, setup, run)  # made before setup, concurrently
            if live is None:
                spec = premade.guest_spec(item, base_spec, keywords)
                if run.plan is None:  # this process's first guest: the run's one decision happens now
                    deciding = time.monotonic()
                    run.pool.plan  # noqa: B018 -- probe, baseline; not this test's own time
                    waited = item.stash[DECISION_KEY] = time.monotonic() - deciding
                    item.add_report_section("setup", "smolvm", f"{waited:.2f}s of this setup went to the run's "
                                            "one-time backend decision (probe, baseline); not counted in its "
                                            "duration")
                if "image" in keywords:  # resolved here first, so that its error names the factory
                    run.pool.baseline_for(spec.image, option="smol_vm_factory(image)")
                live = run.pool.create(item.nodeid, spec, setup, waiting=premade.waiting_note(item))
            problem = ""
        except MarkerError as exc:  # this test's own keywords (a bad image=, say): only it errors
            live, problem = None, str(exc)
        except UsageError as exc:
            # The run's settings are wrong (a bad baseline, say): every guest test would fail alike.
            request.session.shouldstop = f"pytest-smolvm: {exc}"
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
        branching.own(live.vm, made.append)  # its children: this test's guests, destroyed before it
        item.config.hook.pytest_smolvm_vm_ready(item=item, vm=live.vm)
        return live.vm

    try:
        yield make
    finally:
        if made:
            from pytest_smolvm.plugin.reporting import cut_output_note

            note = cut_output_note(live.vm for live in made)
            if note:  # once per test, in the warnings summary: a passing test's transcript is never shown
                warnings.warn(SmolVMWarning(note), stacklevel=1)
            pool = run.pool
            keep = run.settings.keep
            artifacts.before_destroy(item, made)  # files to save need the guests alive
            keeping = keep == "always" or (keep == "failed" and artifacts.failed_so_far(item))
            for live in reversed(made):
                if not keeping:
                    pool.release(live)
                    continue
                try:
                    pool.keep(live)
                except Exception as exc:  # this guest is destroyed instead; the others are still kept
                    warnings.warn(SmolVMWarning(f"guest {live.vm.name} could not be kept ({type(exc).__name__}: "
                                                f"{exc}); it was destroyed instead"), stacklevel=1)
            made.clear()


@pytest.fixture(scope="session")
def smol_baseline_setup() -> Sequence[str]:
    """Shell commands that make the warm baseline, run once per host before any guest forks.

    Override it in a conftest.py (keep it session-scoped) to return your setup commands; the
    pytest_smolvm_prepare_baseline hook is the same thing for code that needs the VM handle.
    """
    return ()


@pytest.fixture
def smol_episode(request: pytest.FixtureRequest) -> Episode:
    """This episode: .index, .seed and .record(reward, **info).

    Without a smol_episodes marker the test is a single episode (index 0).
    """
    episodes_plugin(request.config)  # its line is due at teardown
    from pytest_smolvm.evals import episodes

    return episodes.episode_of(request.node)


@pytest.fixture
def smol_vm(smol_vm_factory: Callable[..., VM]) -> VM:
    """A fresh guest for this test (and so for each parametrized case), destroyed afterwards."""
    return smol_vm_factory()
