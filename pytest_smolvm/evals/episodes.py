"""RL episodes as parametrized tests, rewards, the results JSONL and the closing summary.

- ``@pytest.mark.smol_episodes(n, seed=0)`` parametrizes a test into ``n`` cases ``ep0..ep{n-1}``.
  Each episode's seed is derived from ``(seed, index)`` alone, so every xdist worker collects
  exactly the same ids and seeds (xdist requires identical collection).
- ``smol_episode`` gives the test ``.index``, ``.seed`` and ``.record(reward, **info)``.
- ``--smol-results=PATH``: the process that ran a test appends its line the moment the test's
  teardown report is logged (at once after it is made; pytest-rerunfailures logs an attempt's
  reports once it has decided whether to run it again, and a rerun attempt's line says
  ``"outcome": "rerun"``): one ``write()`` of one whole line, ``O_APPEND``, under ``flock`` on the
  file itself. A worker that dies later has already put its finished lines on disk; lines of
  concurrent workers never interleave. The controller (or the only process) truncates the file
  once, before any worker starts, and writes the line of a test whose worker crashed under it.
- The summary is computed in the controller from the same line dicts, carried on the teardown
  report (attribute ``smolvm_result``), so table and file cannot disagree. The reward also goes
  into the report's ``user_properties`` as ``("smolvm_reward", value)``: JUnit shows it.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
import warnings
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_smolvm.backends.base import egress_counts
from pytest_smolvm.evals import causes
from pytest_smolvm.evals import params as line_params
from pytest_smolvm.evals.glue import PluginGlue
from pytest_smolvm.evals.lines import append_line
from pytest_smolvm.evals.reward import RERUN, is_rerun
from pytest_smolvm.evals.summary import format_compact, format_table, summarize
from pytest_smolvm.session.live import branched_from

if TYPE_CHECKING:
    from pytest_smolvm.session.run import SmolRun

EPISODE_ARG = "_smolvm_episode"  # the internal parametrize argname; never in a test's signature
REWARD_PROPERTY = "smolvm_reward"
SCHEMA_VERSION = 2  # 2: cause and artifacts (docs/evals.md); readers take 1 as well
_CRASHED_ID = re.compile(r"^(?P<function>[^\[]+)\[(?:(?P<case>.*)-)?ep(?P<index>\d+)\]$")


def episode_seed(seed: int, index: int) -> int:
    """The seed of episode ``index`` of a test marked ``smol_episodes(n, seed=seed)``.

    A 32-bit value (what numpy and most simulators accept) from SHA-256, so it is the same on
    every host, Python version and worker, and neighbouring episodes get unrelated seeds.
    """
    digest = hashlib.sha256(f"pytest-smolvm:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


@dataclass(frozen=True)
class EpisodeSpec:
    index: int
    seed: int
    episodes: int


class Episode:
    """What a test gets from the ``smol_episode`` fixture."""

    def __init__(self, spec: EpisodeSpec) -> None:
        self.index = spec.index
        self.seed = spec.seed
        self.episodes = spec.episodes
        self.reward: float | None = None
        self.info: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"<Episode {self.index}/{self.episodes} seed={self.seed} reward={self.reward}>"

    def record(self, reward: float, **info: Any) -> None:
        """Record this episode's reward (a finite number) and JSON-serialisable ``info``.

        Called again, the last call wins: reward and info are both replaced.
        """
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise TypeError(f"smol_episode.record(reward={reward!r}): expected a finite number, "
                            f"got {type(reward).__name__}")
        try:
            value = float(reward)
        except OverflowError:  # an int past float's range
            value = math.inf
        if not math.isfinite(value):
            raise ValueError(f"smol_episode.record(reward={reward!r}): expected a finite number")
        try:
            json.dumps(info, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"smol_episode.record(**info): info must be JSON-serialisable ({exc})") from None
        self.reward, self.info = value, dict(info)


def parse_marker(mark: pytest.Mark, where: str) -> tuple[int, int]:
    """``(n, seed)`` from ``smol_episodes(n, seed=0)``; raises ValueError with a one-line message."""
    label = f"{where}: @pytest.mark.smol_episodes"
    args, kwargs = list(mark.args), dict(mark.kwargs)
    concurrency = kwargs.pop("concurrency", None)  # read by plugin/concurrency.py; checked here, at collection
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency <= 0):
        raise ValueError(f"{label}(concurrency={concurrency!r}): expected a positive integer")
    if len(args) > 2 or set(kwargs) - {"n", "seed"}:
        raise ValueError(f"{label} takes (n, seed=0), got args={tuple(args)!r} kwargs={kwargs!r}")
    names = ["n", "seed"][:len(args)]
    if set(names) & set(kwargs):
        raise ValueError(f"{label}: n or seed given twice")
    values = {**dict(zip(names, args, strict=True)), **kwargs}
    if "n" not in values:
        raise ValueError(f"{label} needs the number of episodes: smol_episodes(n, seed=0)")
    n, seed = values["n"], values.get("seed", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{label}(n={n!r}): n must be a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{label}(seed={seed!r}): seed must be an integer")
    return n, seed


def _short_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    return text.strip().splitlines()[0][:500] if text.strip() else ""


def _outcome(reports: Mapping[str, pytest.TestReport]) -> tuple[str, str]:
    """(outcome, message) of a whole test from its phase reports, pytest's precedence."""
    setup, call, teardown = reports.get("setup"), reports.get("call"), reports.get("teardown")
    if setup is not None and setup.failed:
        return "error", _short_message(setup)
    if call is not None and call.failed:
        return "failed", _short_message(call)
    if teardown is not None and teardown.failed:
        return "error", _short_message(teardown)
    for rep in (setup, call):
        if rep is not None and rep.skipped:
            return ("xfailed" if hasattr(rep, "wasxfail") else "skipped"), _skip_reason(rep)
    if call is not None and hasattr(call, "wasxfail"):
        return "xpassed", ""
    return "passed", ""


def _skip_reason(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).removeprefix("Skipped: ")[:500]
    return _short_message(report)


def _case_id(callspec_id: str, episode_id: str) -> str:
    """The parametrize id without the episode part: ``fizzbuzz-ep3`` -> ``fizzbuzz``."""
    if callspec_id == episode_id:
        return ""
    if callspec_id.endswith("-" + episode_id):
        return callspec_id[: -len(episode_id) - 1]
    return callspec_id.replace(f"{episode_id}-", "", 1)


# ---------------------------------------------------------------------- the plugin object


@dataclass
class _Reports:
    by_phase: dict[str, pytest.TestReport] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)  # what each failed phase raised


EPISODE_KEY = pytest.StashKey[Episode]()
REPORTS_KEY = pytest.StashKey[_Reports]()


def install(config: pytest.Config, run: SmolRun, glue: PluginGlue) -> EpisodesPlugin:
    """From the plugin, when result lines or episodes are first due (see hooks.episodes_plugin)."""
    workerinput = glue.worker_input(config)
    results = run.settings.results
    if workerinput is not None:
        given = workerinput.get(glue.results_path)
        results = Path(given) if given else None  # the controller's resolved path, or none at all
    plugin = EpisodesPlugin(config, run, results, controller=workerinput is None, glue=glue)
    config.pluginmanager.register(plugin, "smolvm-episodes")
    glue.tell_workers(config, glue.results_path,
                      lambda: str(plugin.results.resolve()) if plugin.results is not None else "")
    return plugin


def parametrize(metafunc: pytest.Metafunc) -> None:
    """A test marked ``smol_episodes(n)`` becomes n cases, ids ``ep0``..; from the plugin's
    ``pytest_generate_tests``, which runs after ordinary parametrize so ids read "task-ep0"."""
    mark = metafunc.definition.get_closest_marker("smol_episodes")
    if mark is None:
        return
    try:
        n, seed = parse_marker(mark, metafunc.definition.nodeid)
    except ValueError as exc:
        problem = str(exc)
    else:
        problem = ""
    if problem:  # failed outside the except block, so pytest shows no chained second copy
        pytest.fail(problem, pytrace=False)  # a collection error of one line, like parametrize's own
    specs = [EpisodeSpec(i, episode_seed(seed, i), n) for i in range(n)]
    # The test does not ask for the internal argname; adding it to the closure is how a plugin
    # parametrizes a test over an argument it does not take (pytest-repeat does the same).
    metafunc.fixturenames.append(EPISODE_ARG)
    metafunc.parametrize(EPISODE_ARG, specs, ids=[f"ep{i}" for i in range(n)])


def episode_of(item: pytest.Item) -> Episode:
    """The ``smol_episode`` fixture's value: this case's episode (index 0 of 1 without the marker)."""
    episode = Episode(_spec_of(item) or EpisodeSpec(0, episode_seed(0, 0), 1))
    item.stash[EPISODE_KEY] = episode
    return episode


class EpisodesPlugin:
    def __init__(self, config: pytest.Config, run: SmolRun, results: Path | None, *,
                 controller: bool, glue: PluginGlue) -> None:
        self.config = config
        self.glue = glue
        self.run = run
        self.results = results
        self.controller = controller
        self.lines: list[dict[str, Any]] = []  # controller: every result line seen, for the summary
        self.write_failed = False
        # This process's lines made but not yet logged (written once their teardown report is),
        # and the tests whose attempt in progress pytest-rerunfailures will run again.
        self.unlogged: dict[str, dict[str, Any]] = {}
        self.rerun: set[str] = set()

    # -------------------------------------------------------------- results

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
            None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if report.when == "setup" and (stale := self.unlogged.pop(item.nodeid, None)) is not None:
            # The last attempt's reports were never logged: pytest-rerunfailures with an xdist too
            # old for it drops the reports of an attempt it runs again.
            stale["outcome"] = RERUN
            self.write(stale)
        reports = (state := item.stash.setdefault(REPORTS_KEY, _Reports())).by_phase
        reports[report.when] = report
        if call.excinfo is not None:
            state.errors[report.when] = call.excinfo.value
        if report.when == "teardown" and (self.results is not None or _spec_of(item) is not None
                                          or EPISODE_KEY in item.stash):  # else nobody reads the line
            line = self.result_line(item, reports)
            # An attribute, not a user property: xdist carries it to the controller all the same
            # (reports travel as their __dict__), and JUnit XML is spared a JSON blob per test.
            setattr(report, self.glue.result_attr, line)
            if line.get("reward") is not None:
                report.user_properties = [*report.user_properties, (REWARD_PROPERTY, line["reward"])]
            # Written when the report is logged, in this process: pytest logs it at once, and
            # pytest-rerunfailures once it knows whether the attempt is a rerun (logreport below).
            self.unlogged[item.nodeid] = line
        if report.when == "teardown":
            # The phases' exceptions hold their tracebacks, and those the test's frames: kept on
            # the item (which pytest keeps to the end), every failed episode's locals would too.
            del item.stash[REPORTS_KEY]
        return report

    def result_line(self, item: pytest.Item, reports: Mapping[str, pytest.TestReport]) -> dict[str, Any]:
        outcome, message = _outcome(reports)
        spec = _spec_of(item)
        episode = item.stash.get(EPISODE_KEY, None)
        callspec = getattr(item, "callspec", None)
        params = line_params.of((k, v) for k, v in (callspec.params.items() if callspec else ()) if k != EPISODE_ARG)
        case = callspec.id if callspec else ""
        if spec is not None and callspec is not None:
            case = _case_id(callspec.id, f"ep{spec.index}")
        function = item.nodeid[: -len(callspec.id) - 2] if callspec else item.nodeid
        guests = self.glue.finished_guests(item)
        first = guests[0].vm if guests else None
        durations = {when: round(rep.duration, 6) for when, rep in reports.items()}
        durations["provision"] = round(sum(g.provision_seconds for g in guests), 6)
        durations["destroy"] = round(sum(g.destroy_seconds for g in guests), 6)
        return {
            "v": SCHEMA_VERSION,
            "test": item.nodeid,
            "function": function,
            "case": case,
            "params": params,
            "episode": spec.index if spec else (episode.index if episode else None),
            "episodes": spec.episodes if spec else (episode.episodes if episode else None),
            "seed": spec.seed if spec else (episode.seed if episode else None),
            "outcome": outcome,
            "cause": causes.of(outcome, reports, item.stash[REPORTS_KEY].errors, guests),
            "message": message,
            "reward": episode.reward if episode else None,
            "info": episode.info if episode else {},
            "durations": durations,
            "vms": [g.vm.name for g in guests],
            **({"branches": b} if (b := branched_from(guests)) else {}),  # vm.branch's children
            "egress": egress_counts([a for g in guests for a in g.egress]),
            "backend": first.backend if first else self._backend(),
            "baseline": first.baseline if first else None,
            "baseline_digest": first.digest if first else None,
            "worker": self.run.worker,
            "run_id": self.run.run_id,
            "artifacts": self.glue.saved_dir(item),
        }

    def write(self, line: Mapping[str, Any]) -> None:
        if self.results is None:
            return
        try:
            append_line(self.results, line)
        except OSError as exc:  # an unwritable results file must not fail the tests; say it loudly once
            if not self.write_failed:
                self.write_failed = True
                warnings.warn(pytest.PytestWarning(
                    f"pytest-smolvm: could not append to --smol-results {self.results}: {exc}"), stacklevel=1)

    @pytest.hookimpl(tryfirst=True)  # before xdist's sessionstart starts the workers
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.controller and self.results is not None:
            try:
                self.results.parent.mkdir(parents=True, exist_ok=True)
                self.results.write_bytes(b"")
            except OSError as exc:
                raise pytest.UsageError(f"--smol-results={self.results}: cannot create it: {exc}") from None

    @pytest.hookimpl(tryfirst=True)  # a worker's line is marked a rerun before xdist sends the report on
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.outcome == RERUN and report.when in ("setup", "call"):  # pytest-rerunfailures runs it again
            self.rerun.add(report.nodeid)
        if report.when == "teardown":
            line = getattr(report, self.glue.result_attr, None)
            rerun = report.nodeid in self.rerun or report.outcome == RERUN
            self.rerun.discard(report.nodeid)
            if not isinstance(line, dict):
                return
            if rerun:
                line["outcome"] = RERUN  # the test's last attempt is its episode; this one is not
            if self.unlogged.get(report.nodeid) is line:  # made in this process: its line to write
                del self.unlogged[report.nodeid]
                self.write(line)  # now, in the process that ran the test: a later crash cannot lose it
            if self.controller:
                self.lines.append(line)
        elif self.controller and str(report.when) == "???":  # xdist's report for a test whose worker died under it
            line = self.crashed_line(report)
            self.lines.append(line)
            self.write(line)

    def crashed_line(self, report: pytest.TestReport) -> dict[str, Any]:
        match = _CRASHED_ID.match(report.nodeid)
        node = getattr(report, "node", None)
        worker = getattr(getattr(node, "gateway", None), "id", None)
        return {
            "v": SCHEMA_VERSION, "test": report.nodeid,
            "function": match["function"] if match else report.nodeid.split("[")[0],
            "case": (match["case"] or "") if match else "", "params": {},
            "episode": int(match["index"]) if match else None, "episodes": None, "seed": None,
            "outcome": RERUN if report.outcome == RERUN else "error",  # pytest-rerunfailures runs it again
            "cause": "crashed", "message": str(report.longrepr)[:500], "reward": None,
            "info": {}, "durations": {}, "vms": self.run.crashed_guests.get(report.nodeid, []), "artifacts": None,
            "backend": self._backend(), "baseline": None,
            "baseline_digest": None, "worker": worker, "run_id": self.run.run_id, "crashed": True,
        }

    def _backend(self) -> str | None:
        """The run's backend if it was decided (a test without a guest never decides it)."""
        plan = self.run.plan
        return plan.backend if plan is not None else None

    # -------------------------------------------------------------- summary

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.controller:
            return
        rows = summarize(self.lines)
        verbosity = self.config.get_verbosity()
        if rows and verbosity >= -1:
            terminalreporter.section("smolvm episodes")
            texts = format_compact(rows)
            if verbosity >= 0:  # the table, then the viewer's intervals and outcome breakdown
                from pytest_smolvm.evals.results.terminal import details

                texts = [*format_table(rows), *details(self.lines)]
            for text in texts:
                terminalreporter.line(text)
        if self.results is not None and verbosity >= -1:
            reruns = sum(map(is_rerun, self.lines))
            terminalreporter.line(f"smolvm: {len(self.lines)} result line(s) in {self.results}"
                                  + (f" ({reruns} of them rerun attempts, not counted as episodes)" if reruns else ""))


def _spec_of(item: pytest.Item) -> EpisodeSpec | None:
    callspec = getattr(item, "callspec", None)
    spec = callspec.params.get(EPISODE_ARG) if callspec is not None else None
    return spec if isinstance(spec, EpisodeSpec) else None
