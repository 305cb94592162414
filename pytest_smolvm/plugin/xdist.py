"""Everything pytest-xdist's controller and workers say to each other: one module, every key.

The controller tells each worker, through ``workerinput``, the run it belongs to, where the plan
service listens, and the paths the controller resolved (relative paths must mean the same file
in every process); each worker tells the controller, through ``workeroutput``, what went wrong
in its teardowns and what long host work it did. The controller also picks xdist's scheduler
under ``--smol-concurrency`` (plugin/scheduling.py), and reports each test a crashed worker had
in flight, where xdist reports one. Only the controller registers :class:`Controller`, and only
where xdist is installed: its hook names exist only then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from pytest_smolvm.errors import SmolVMError
from pytest_smolvm.plugin import internals

if TYPE_CHECKING:
    from pytest_smolvm.session.run import SmolRun

# workerinput: controller -> worker
RUN_ID = "smolvm_run_id"  # the run's id, the same in every process
PLAN_SERVICE = "smolvm_plan_service"  # the controller's plan service, "host:port:secret"
ARTIFACTS_DIR = "smolvm_artifacts"  # the controller's resolved --smol-artifacts dir, or absent
RESULTS_PATH = "smolvm_results"  # the controller's resolved --smol-results path, or "" for none
# workeroutput: worker -> controller
PROBLEMS = "smolvm_problems"  # teardown problems the worker met, for the controller's summary
WORK = "smolvm_work"  # the worker's long host-side work (pulls, unpacks), for the summary
ADMISSION = "smolvm_admission"  # {gate: [peak held host-wide as the worker saw it, bound]}
# on a test's teardown report (reports travel to the controller as their __dict__)
RESULT_ATTR = "smolvm_result"  # the test's --smol-results line (evals/episodes.py)
GUESTS_ATTR = "smolvm_guests"  # on a setup report: the names of the guests the test has by then

CONTROLLER_NAME = "smolvm-xdist"


def worker_input(config: pytest.Config) -> dict[str, Any] | None:
    """What the controller told this worker; None in the controller or a run without xdist."""
    found: dict[str, Any] | None = getattr(config, "workerinput", None)
    return found


def is_worker(config: pytest.Config) -> bool:
    return worker_input(config) is not None


def report_to_controller(config: pytest.Config, problems: list[str], work: list[str],
                         admission: dict[str, list[int]] | None = None) -> None:
    """Hand this worker's teardown problems, host work and admission peaks to the controller
    (a no-op elsewhere)."""
    output = getattr(config, "workeroutput", None)
    if output is not None:
        output[PROBLEMS] = list(problems)
        output[WORK] = list(work)
        output[ADMISSION] = dict(admission or {})


class Controller:
    """The controller's side: inputs for every worker it starts, outputs from every one that ends."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.worker_slots = 1  # --smol-concurrency: tests each worker keeps in flight
        self.all_concurrent: Callable[[], set[str]] = set  # the workers whose every test runs concurrently
        # Per worker: tests set up and not yet torn down (id -> location); more than one only
        # under --smol-concurrency or a smol_episodes(concurrency=) marker.
        self._in_flight: dict[str, dict[str, tuple[str, int | None, str]]] = {}
        self._guests: dict[str, list[str]] = {}  # test id -> its guests, as its setup report named them
        self._inputs: dict[str, Callable[[], str | None]] = {}
        self.problems: list[str] = []
        self.work: list[str] = []
        self.admission: list[dict[str, list[int]]] = []
        self._on_node_down: list[Callable[[str | None, bool], None]] = []

    def tell_workers(self, key: str, value: Callable[[], str | None]) -> None:
        """Give every worker ``key``, with ``value()`` as it is when the worker starts (None: omit)."""
        self._inputs[key] = value

    def on_worker_down(self, callback: Callable[[str | None, bool], None]) -> None:
        """Call ``callback(worker id, crashed)`` whenever a worker ends, before the tests a crashed
        worker had in flight are reported."""
        self._on_node_down.append(callback)

    @pytest.hookimpl(tryfirst=True)  # before xdist's own, which always answers
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if self.worker_slots <= 1:
            return None  # xdist's own, without importing its schedulers here
        from pytest_smolvm.plugin.scheduling import make_scheduler

        return make_scheduler(config, log, self.worker_slots, self.all_concurrent)

    def pytest_configure_node(self, node: Any) -> None:
        for key, value in self._inputs.items():
            given = value()
            if given is not None:
                node.workerinput[key] = given

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        worker = _worker_id(getattr(report, "node", None))
        if worker is None:
            return
        if report.when == "setup":
            self._in_flight.setdefault(worker, {})[report.nodeid] = report.location
            names = getattr(report, GUESTS_ATTR, None)
            if names:
                self._guests[report.nodeid] = list(names)
        elif report.when == "teardown":
            self._in_flight.get(worker, {}).pop(report.nodeid, None)
            self._guests.pop(report.nodeid, None)

    def lost_guests(self, worker: str, recorded: dict[str, list[str]]) -> dict[str, list[str]]:
        """The guests of each test a crashed ``worker`` had: those its setup report named, and
        those ``recorded`` (test id -> names, from the guest records), made later, whose records
        the worker's own cleanup (the namespace helper's, racing this) has not removed yet."""
        lost = {nodeid: list(self._guests[nodeid]) for nodeid in self._in_flight.get(worker, {})
                if nodeid in self._guests}
        for nodeid, names in recorded.items():
            known = lost.setdefault(nodeid, [])
            known.extend(name for name in names if name not in known)
        return lost

    def _report_lost_in_flight(self, node: Any) -> None:
        """A crashed worker's tests in flight, as xdist reports the one it knows it was running.

        xdist sees a test as done once the worker has started it, so of a crashed worker's tests
        in flight it reports only the one it had not yet seen start; the others had no report at
        all (no terminal line, no JUnit entry, no results line)."""
        lost = self._in_flight.pop(_worker_id(node) or "", {})
        not_started = internals.not_seen_started(self.config, node)
        for nodeid, location in lost.items():
            if nodeid in not_started:
                continue  # xdist reports it (the first of them) or runs it elsewhere
            report = pytest.TestReport(nodeid, location, {}, "failed",
                                       f"worker {_worker_id(node)!r} crashed while {nodeid!r} was in flight",
                                       "???")  # type: ignore[arg-type]  # xdist's phase for a crash
            report.node = node  # type: ignore[attr-defined]  # as xdist labels the reports it relays
            self.config.hook.pytest_runtest_logreport(report=report)

    def pytest_testnodedown(self, node: Any, error: object) -> None:
        output = getattr(node, "workeroutput", {})
        self.problems.extend(output.get(PROBLEMS, []))
        self.work.extend(output.get(WORK, []))
        self.admission.append(output.get(ADMISSION, {}))
        for callback in self._on_node_down:
            callback(_worker_id(node), bool(error))
        if error:
            self._report_lost_in_flight(node)


def controller(config: pytest.Config) -> Controller | None:
    """This run's :class:`Controller`, made on first use; None in a worker or without xdist."""
    if is_worker(config) or not config.pluginmanager.hasplugin("xdist"):
        return None
    found = config.pluginmanager.get_plugin(CONTROLLER_NAME)
    if found is None:
        found = Controller(config)
        config.pluginmanager.register(found, CONTROLLER_NAME)
    assert isinstance(found, Controller)
    return found


def say_if_all_concurrent(run: SmolRun, takes: Callable[[pytest.Item], int], items: list[pytest.Item]) -> None:
    """From a worker's collection, before xdist hands the controller its ids: whether every test
    runs concurrently, --smol-concurrency at a time. Only then may the controller split a run
    that fits the slots evenly up front (plugin/scheduling.py); a synchronous test is better
    rebalanced as it finishes. If the controller cannot be told, it keeps xdist's scheduling."""
    slots = run.settings.concurrency
    if slots <= 1 or not all(takes(item) >= slots for item in items):
        return
    from pytest_smolvm.session.plan import RemotePlanner

    planner = run.planner
    if isinstance(planner, RemotePlanner):  # the controller's plan service, as the plan is asked for
        try:
            planner.say_all_concurrent(run.worker)
        except SmolVMError:
            pass


def _worker_id(node: Any) -> str | None:
    """xdist's id of a worker ("gw0") from its WorkerController, as reports carry it."""
    found = getattr(getattr(node, "gateway", None), "id", None)
    return found if isinstance(found, str) else None
