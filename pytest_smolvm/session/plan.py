"""The RunPlan: which backend, target and baseline a run uses, and why, decided once per run.

The process that outlives the others (the xdist controller, or the only pytest process) owns
the decision. It is made lazily, when the first guest is asked for, never at startup: a project
that has the plugin installed but no guest test pays for nothing.

- :class:`Planner` lives in that process. It probes, picks the backend, resolves and checks the
  baseline, reaps what dead runs left, and calls ``Backend.prepare_run`` on the backend
  instance it owns for the whole run (the smol backend's shared source lives there, so it
  outlives every worker). It also makes machines on workers' behalf (:meth:`share_source`).
- Under xdist, ``handover.PlanService`` serves the planner to workers over a loopback socket whose
  address and secret reach them through ``workerinput``; a worker's :class:`RemotePlanner` asks
  for the plan the first time one of its tests wants a guest. Workers never decide anything
  themselves, so one run never mixes backends or baselines.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pytest_smolvm.backends import backend_class
from pytest_smolvm.backends.base import Backend, BackendOptions, VMSpec, spec_from_json, spec_to_json
from pytest_smolvm.backends.selection import select_backend
from pytest_smolvm.baselines import baseline as baselines
from pytest_smolvm.errors import ProvisionError, UsageError
from pytest_smolvm.session import reaper
from pytest_smolvm.session.settings import Settings


@dataclass(frozen=True)
class RunPlan:
    """Everything a process needs to make this run's guests, the same in every process."""

    run_id: str
    backend: str
    target: str
    isolation: str
    reason: str
    baseline: baselines.Baseline
    shared: Mapping[str, str] = field(default_factory=dict)  # Backend.prepare_run's hand-over

    def to_json(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["baseline"]["path"] = str(self.baseline.path) if self.baseline.path else None
        raw["shared"] = dict(self.shared)
        return raw

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RunPlan:
        base = dict(raw["baseline"])
        base["path"] = Path(base["path"]) if base.get("path") else None
        return cls(**{**raw, "baseline": baselines.Baseline(**base), "shared": dict(raw["shared"])})


class PlanSource(Protocol):
    """What a process's pool asks for the plan: the planner itself, or a worker's stand-in."""

    def plan(self) -> RunPlan: ...

    def share_source(self, spec: VMSpec) -> str: ...


class Planner:
    """The one decision per run, made on first use; owns the run-wide backend instance."""

    def __init__(self, settings: Settings, run_id: str, worker: str) -> None:
        self.settings = settings
        self.run_id = run_id
        self.worker = worker
        self.backend: Backend | None = None
        # xdist workers whose every collected test runs concurrently (plugin/scheduling.py asks)
        self.all_concurrent: set[str] = set()
        self._plan: RunPlan | None = None
        self._error: UsageError | ProvisionError | None = None
        self._lock = threading.Lock()

    @property
    def resolved(self) -> RunPlan | None:
        """The plan if one was made (never triggers the decision)."""
        return self._plan

    def plan(self) -> RunPlan:
        with self._lock:
            if self._plan is None and self._error is None:
                try:
                    self._plan = self._decide()
                except (UsageError, ProvisionError) as exc:
                    self._error = exc  # decided once: every later request gets the same answer
            if self._error is not None:
                raise type(self._error)(str(self._error))
            assert self._plan is not None
            return self._plan

    def _decide(self) -> RunPlan:
        settings = self.settings
        selection = select_backend(settings.backend, settings.target)
        cls = backend_class(selection.name)
        default = resolve_baseline(settings.baseline, settings, selection.name,
                                   option=settings.baseline_option, run_id=self.run_id)
        reaper.reap_dead(cls)  # what dead runs left, now that we know this run uses guests
        backend = cls(BackendOptions(target=settings.target, labels={"run": self.run_id, "worker": self.worker}))
        try:
            shared = backend.prepare_run(default)
        except BaseException:
            _close_quietly(backend)
            raise
        self.backend = backend
        return RunPlan(self.run_id, selection.name, settings.target, cls.isolation, selection.reason, default, shared)

    def share_source(self, spec: VMSpec) -> str:
        self.plan()
        assert self.backend is not None
        return self.backend.share_source(spec)

    def close(self) -> list[str]:
        """Release the run-wide backend (after every worker is done); returns problems, never raises."""
        backend, self.backend = self.backend, None
        return _close_quietly(backend) if backend is not None else []


def resolve_baseline(requested: str | None, settings: Settings, backend: str, *, option: str,
                     run_id: str) -> baselines.Baseline:
    """``requested`` as ``backend`` will use it: resolved, pinned and pulled if it is a registry
    image, and checked; a bad one is a UsageError naming ``option``."""
    found = baselines.resolve(requested, settings.rootdir, option=option)
    if found.kind == "registry":  # the OCI client's imports (urllib, ssl) only for an image
        from pytest_smolvm.baselines.oci.pull import pin_registry_image

        found = pin_registry_image(found, settings, backend, option=option, run_id=run_id)
    backend_class(backend).check_baseline(found, option=option)
    return found


def _close_quietly(backend: Backend) -> list[str]:
    try:
        backend.close()
    except Exception as exc:  # a teardown problem is reported, never an INTERNALERROR
        return [f"{type(exc).__name__}: {exc}"]
    return []


# --------------------------------------------------------------------------- xdist hand-over


def answer(planner: Planner, request: dict[str, Any]) -> dict[str, Any]:
    """The controller's reply to a worker's request (see handover.py for the transport)."""
    try:
        if request.get("op") == "plan":
            return {"plan": planner.plan().to_json()}
        if request.get("op") == "share_source":
            return {"name": planner.share_source(spec_from_json(request["spec"]))}
        if request.get("op") == "all_concurrent":
            planner.all_concurrent.add(str(request.get("worker")))
            return {}
        return {"error": f"unknown request {request.get('op')!r}", "kind": "provision"}
    except UsageError as exc:
        return {"error": str(exc), "kind": "usage"}
    except Exception as exc:  # the worker shows it; the controller must keep serving
        return {"error": str(exc) if isinstance(exc, ProvisionError) else f"{type(exc).__name__}: {exc}",
                "kind": "provision"}


class RemotePlanner:
    """A worker's view of the controller's planner (asked once for the plan, then cached)."""

    def __init__(self, address: str) -> None:
        host, port, self._secret = address.rsplit(":", 2)
        self._address = (host, int(port))
        self._plan: RunPlan | None = None
        self._lock = threading.Lock()

    @property
    def resolved(self) -> RunPlan | None:
        return self._plan

    def plan(self) -> RunPlan:
        with self._lock:
            if self._plan is None:
                self._plan = RunPlan.from_json(self._ask({"op": "plan"})["plan"])
            return self._plan

    def close(self) -> list[str]:
        return []  # the controller owns everything run-wide

    def share_source(self, spec: VMSpec) -> str:
        return str(self._ask({"op": "share_source", "spec": spec_to_json(spec)})["name"])

    def say_all_concurrent(self, worker: str) -> None:
        """Tell the controller that every test this worker collected runs concurrently."""
        self._ask({"op": "all_concurrent", "worker": worker})

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            with socket.create_connection(self._address) as sock:
                sock.sendall(json.dumps({**request, "secret": self._secret}).encode() + b"\n")
                with sock.makefile("rb") as replies:
                    line = replies.readline()
        except OSError as exc:
            raise ProvisionError(f"could not reach the xdist controller's run plan ({exc})") from exc
        if not line:
            raise ProvisionError("the xdist controller closed the connection before answering (did it exit?)")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise (UsageError if reply.get("kind") == "usage" else ProvisionError)(reply["error"])
        return reply
