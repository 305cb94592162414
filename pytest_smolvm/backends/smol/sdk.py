"""Every use of the smolmachines SDK that its public API does not promise, in one place.

Read from smolmachines ``SDK_VERSION_READ``. When the installed version differs,
``private_api_problems()`` says what no longer holds, and tests/test_smol_sdk.py fails
loudly: re-read the SDK source named in each function and update this module.

Importing this module does not import ``smol`` (importing ``smol`` mutates ``os.environ``).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_smolvm.backends.output import BoundedBuffer

if TYPE_CHECKING:
    from smol import ExecOptions, Machine, SmolError

SDK_VERSION_READ = "1.37.3"


def installed_version() -> str | None:
    try:
        return version("smolmachines")
    except PackageNotFoundError:
        return None


def exec_cancellable(machine: Machine, command: list[str],
                     opts: ExecOptions) -> tuple[Any, Callable[[], Any]] | tuple[None, None]:
    """``(canceller, run)`` for an exec another thread can kill, or ``(None, None)``.

    ``Machine._exec_cancellable`` (machine.py:405-412) is private: it wraps the local
    transport's ``canceller()`` (transport.py:807-809) so a host-side timer can kill a command
    whose guest agent never enforced its timeout. The cloud has no canceller (None, None).
    """
    make = getattr(machine, "_exec_cancellable", None)
    if make is None:
        return None, None
    canceller, run = make(command, opts)
    if canceller is None:
        return None, None
    return canceller, run


def vm_data_dir(name: str) -> Path:
    """Where the local engine keeps a machine's disks and logs.

    ``$XDG_CACHE_HOME/smolvm/vms/<sha256(name)[:16]>`` ("hash-derived, not name-derived",
    ``smol-vmm machine data-dir --help``); the SDK has no call for it, and the engine deletes
    it with the machine, so logs are read from here before a delete.
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "smolvm" / "vms" / hashlib.sha256(name.encode()).hexdigest()[:16]


def remove_fork_lock(name: str) -> None:
    """Remove the ``.<name>.fork-operation.lock`` the engine leaves next to the data dirs for
    every name it deleted (seen on 1.32.2, even for names that never existed).

    Names here are unique per machine, so once the machine is gone nobody can want its lock.
    """
    with contextlib.suppress(OSError):
        (vm_data_dir(name).parent / f".{name}.fork-operation.lock").unlink()


class StartFailed(Exception):
    """A cloud machine's start failed (``error``: the SDK's ``SmolError``): the create is over.

    Not a ``SmolError`` on purpose: the SDK's create catches those from its start and waits out
    the readiness timeout anyway; this passes its ``except SmolError`` and reaches its cleanup
    (the machine is deleted), then the caller."""

    def __init__(self, error: SmolError) -> None:
        super().__init__(str(error))
        self.error = error


_START_PATH = re.compile(r"^/v1/machines/[^/?]+/start(\?.*)?$")
_BRANCH_PATH = re.compile(r"^/v1/machines/[^/?]+/(branches|branches/batch|fork|fork-batch)$")
_checked_start = threading.local()  # the bound (seconds) in threads that asked, else unset
_patch_lock = threading.Lock()
# clone id -> the monotonic time its readiness wait must end by: set when a bounded branch is
# answered, taken by the wait (which fork_batch runs in threads of its own, outside the bound)
_ready_by: dict[str, float] = {}
_ready_lock = threading.Lock()  # the branch answers and the waits come from many threads
_exec_bound = threading.local()  # the ExecBound of the exec_bounded block this thread is in


def engine_bounded(target: str, ready: float | None = None) -> contextlib.AbstractContextManager[None]:
    """:func:`start_checked` for a cloud target (``LIMITS.smol_call``, read now), else nothing."""
    from pytest_smolvm import limits

    return start_checked(limits.LIMITS.smol_call, ready) if target == "cloud" else contextlib.nullcontext()


@contextlib.contextmanager
def start_checked(bound: float, ready: float | None = None) -> Iterator[None]:
    """Cloud calls in this thread that start or branch a machine, bounded; a start retried, not
    swallowed.

    A branch POST goes out with the SDK's 30-minute ``CLOUD_START_TIMEOUT_S`` (transport.py:
    1898-1928, 1965-1983): a control plane that never answers held a test's setup that long. In
    this block its timeout is ``bound``; the SDK's error then is a retryable provisioning error.

    ``make_transport``'s cloud create (transport.py:2953-2995) sends the start POST with the
    30-minute ``CLOUD_START_TIMEOUT_S``, not as idempotent (so the SDK never resends it, even on a
    503 that says retry), and catches its ``SmolError``: one 503 there left the machine created,
    never started, and the run waited the whole readiness timeout. In this block that POST
    (``_cloud_fetch``, transport.py:2381-2416) goes out idempotent, as the SDK's own
    ``CloudTransport.start`` sends it (transport.py:1761-1775; the engine's start of a started
    machine is a no-op), so the SDK's retry loop resends it where the error says retry, with a
    timeout of ``bound``; if it still fails, :class:`StartFailed` ends the create at once.

    A branch's answer is followed by the SDK's readiness wait for each clone (module-global
    ``_wait_for_ready``, transport.py:1936 and, in a thread pool, 1995) with its default 120 s,
    whatever the caller's bound: a clone stuck booting held the test's setup that long. The ids a
    bounded branch returns get ``ready`` (else ``bound``) from its answer, and the wait ends there
    with the SDK's own ``TIMEOUT`` error (retryable: the pool makes the guest again).
    """
    from smol import SmolError, transport

    with _patch_lock:
        if not getattr(transport._cloud_fetch, "_pytest_smolvm", False):
            original = transport._cloud_fetch

            def fetch(base_url: str, api_key: str, method: str, path: str, **kwargs: Any) -> Any:
                limit = getattr(_checked_start, "bound", None)
                if limit is not None and method == "POST" and _BRANCH_PATH.match(path):
                    kwargs["timeout"] = min(float(kwargs.get("timeout") or limit), limit)
                    answer = original(base_url, api_key, method, path, **kwargs)
                    _bound_readiness(answer, getattr(_checked_start, "ready", None) or limit)
                    return answer
                if limit is None or method != "POST" or not _START_PATH.match(path):
                    return original(base_url, api_key, method, path, **kwargs)
                kwargs["idempotent"] = True
                kwargs["timeout"] = min(float(kwargs.get("timeout") or limit), limit)
                try:
                    return original(base_url, api_key, method, path, **kwargs)
                except SmolError as exc:
                    raise StartFailed(exc) from exc

            fetch._pytest_smolvm = True  # type: ignore[attr-defined]
            fetch.__wrapped__ = original  # type: ignore[attr-defined]
            transport._cloud_fetch = fetch

            wait_for_ready = transport._wait_for_ready

            def wait(base_url: str, api_key: str, machine_id: str, timeout_s: float = 120.0,
                     interval_s: float = 1.0) -> None:
                with _ready_lock:
                    deadline = _ready_by.pop(machine_id, None)
                if deadline is not None:
                    timeout_s = max(0.0, min(timeout_s, deadline - time.monotonic()))
                wait_for_ready(base_url, api_key, machine_id, timeout_s=timeout_s, interval_s=interval_s)

            wait.__wrapped__ = wait_for_ready  # type: ignore[attr-defined]
            transport._wait_for_ready = wait
    _checked_start.bound, _checked_start.ready = bound, ready
    try:
        yield
    finally:
        _checked_start.bound = _checked_start.ready = None


def _bound_readiness(answer: Any, bound: float) -> None:
    """Note the clones a branch answered with (``{"id"}``, or ``{"clones": [{"id"}]}`` for a
    batch: transport.py:1933, 1985-1989) as due ready within ``bound``."""
    now = time.monotonic()
    answer = answer if isinstance(answer, dict) else {}
    clones = [answer, *(answer.get("clones") or [])]
    with _ready_lock:
        for stale in [key for key, deadline in _ready_by.items() if deadline < now]:
            del _ready_by[stale]  # answers whose wait never came (the SDK raised first)
        for clone in clones:
            if isinstance(clone, dict) and isinstance(clone.get("id"), str):
                _ready_by[clone["id"]] = now + bound


class ExecBound:
    """What :func:`exec_bounded` holds a resumable exec to, and whether its output was ``cut``."""

    def __init__(self, seconds: float | None, output_limit: int | None, resumable: bool = True) -> None:
        self.seconds, self.output_limit, self.resumable = seconds, output_limit, resumable
        self.cut = False  # the node dropped output before it was read: the streams have a hole


@contextlib.contextmanager
def exec_bounded(timeout: float | None, output_limit: int | None, *, resumable: bool = True) -> Iterator[ExecBound]:
    """Resumable cloud execs this thread starts in this block, bounded on the host.

    From 1.37.3 ``CloudTransport.exec`` and ``exec_stream`` run a command as a resumable exec
    where the control plane has them (``_ResumableExec``, transport.py:2253-2364; made at
    1334 and 1386). Its reads ride out failures for ``_RESUMABLE_BUDGET_S`` (600 s) and
    nothing ends it but the command's end: the plain exec's HTTP timeout (the command's timeout
    + 30 s, 1297-1300) is gone, so a node that never enforced a timeout held the call for ever.
    And ``exec`` keeps every byte the command printed (1338-1345) before our cap applied:
    200 MB a guest printed were 200 MB of the host's memory; output the node dropped before it
    was read (``lost``) failed the whole exec (1354-1359).

    In this block such an exec is killed (its ``DELETE``, as ``exec_stream``'s kill does) once
    ``timeout`` + ``LIMITS.smol_exec_cancel_grace`` have passed, ending in the SDK's
    ``TIMEOUT`` error. With an ``output_limit``, each stream's head and tail are kept, a byte
    more than the cap together (so the caller sees that it was cut), while it reads on to the
    exit status; lost output marks the result ``cut``. ``None``: no bound.

    ``resumable=False`` makes such an exec the plain one (as on a control plane without them,
    1385-1393): the host's file transfers stream there, since a node drops a resumable exec's
    output that its reader has not taken in time (``lost``: a 64 MiB read through the loopback
    cloud lost 16 of its 89 MB of base64 in one run), and a transfer with a hole is no transfer.
    A command run as a user always takes the plain exec: there the SDK checks that the control
    plane applied the user (``_ensure_user``, ``_check_user_echo``: 1292-1293, 1312-1313, 1394-1395); on the
    resumable path it checks nothing (1288-1291), and a plane that ignored the field would run
    the command as the image's default account, root.
    """
    from pytest_smolvm import limits

    _install_exec_bound()
    bound = ExecBound(None if timeout is None else timeout + limits.LIMITS.smol_exec_cancel_grace, output_limit,
                      resumable)
    previous = getattr(_exec_bound, "value", None)
    _exec_bound.value = bound
    try:
        yield bound
    finally:
        _exec_bound.value = previous


def _install_exec_bound() -> None:
    from smol import SmolError, transport

    with _patch_lock:
        resumable = getattr(transport, "_ResumableExec", None)
        if resumable is None or getattr(resumable, "_pytest_smolvm", False):
            return  # an SDK before resumable execs (bounded by its HTTP timeout), or done already

        class BoundedResumableExec(resumable):  # type: ignore[misc, valid-type]
            _pytest_smolvm = True

            def start(self) -> bool:
                self._bound: ExecBound = getattr(_exec_bound, "value", None) or ExecBound(None, None)
                self._expired = False
                self._timer: threading.Timer | None = None
                if not self._bound.resumable or self._body.get("user") is not None:
                    return False  # the SDK's answer to "this control plane has none": the plain exec
                if self._bound.seconds is not None:
                    self._timer = threading.Timer(self._bound.seconds, self._expire)
                    self._timer.daemon = True
                    self._timer.start()
                try:
                    started = bool(super().start())
                except SmolError as exc:
                    self._stop_timer()
                    if self._expired:
                        raise self._timed_out() from exc
                    raise
                except BaseException:
                    self._stop_timer()
                    raise
                if not started:
                    self._stop_timer()
                return started

            def _expire(self) -> None:
                self._expired = True
                self.cancelled.set()  # no more reads or retries
                self.forget()  # the node kills the command

            def _stop_timer(self) -> None:
                if self._timer is not None:
                    self._timer.cancel()

            def _timed_out(self) -> SmolError:
                return SmolError("TIMEOUT", f"exec killed by the host after {self._bound.seconds:g}s "
                                 "(its timeout and the grace after it)")

            def pieces(self) -> Iterator[tuple[Any, ...]]:
                limit = self._bound.output_limit
                kept = {name: BoundedBuffer(limit + 2) for name in ("stdout", "stderr")} if limit is not None else {}
                try:
                    for piece in super().pieces():
                        if piece[0] == "lost":
                            self._bound.cut = True
                            if kept:
                                continue  # a hole, like the middle a bounded stream drops
                        elif piece[0] in kept:
                            kept[piece[0]].add(piece[1])
                            continue
                        elif piece[0] == "end":  # what was kept, whole, then the end
                            yield from ((name, buffer.value()) for name, buffer in kept.items())
                        yield piece
                finally:
                    self._stop_timer()
                if self._expired:
                    raise self._timed_out()

        BoundedResumableExec.__name__ = BoundedResumableExec.__qualname__ = "_ResumableExec"
        transport._ResumableExec = BoundedResumableExec  # type: ignore[misc]


def private_api_problems() -> list[str]:
    """What this module relies on that the installed SDK no longer offers (empty: all holds),
    a version other than the one read first."""
    installed = installed_version()
    if installed is None:
        return ["smolmachines is not installed"]
    problems = []
    if installed != SDK_VERSION_READ:
        problems.append(f"smolmachines {installed} is installed but pytest_smolvm.backends.smol.sdk.py was "
                        f"read from {SDK_VERSION_READ}: re-read the SDK and update it")
    return problems + internals_problems()


def internals_problems() -> list[str]:
    """The SDK internals this module uses that the installed SDK lacks or has changed (imports ``smol``)."""
    problems = []
    from smol import Machine
    from smol.transport import LocalTransport

    make = getattr(Machine, "_exec_cancellable", None)
    if make is None:
        problems.append("Machine._exec_cancellable is gone")
    elif list(inspect.signature(make).parameters) != ["self", "command", "opts"]:
        problems.append(f"Machine._exec_cancellable{inspect.signature(make)} changed shape")
    if not callable(getattr(LocalTransport, "canceller", None)):
        problems.append("LocalTransport.canceller is gone")
    from smol import transport

    fetch = inspect.unwrap(transport._cloud_fetch) if hasattr(transport, "_cloud_fetch") else None
    if fetch is None or not {"timeout", "idempotent"} <= set(inspect.signature(fetch).parameters):
        problems.append("smol.transport._cloud_fetch(..., timeout=, idempotent=) is gone (start_checked)")
    elif '/start"' not in inspect.getsource(transport.make_transport):
        problems.append("make_transport no longer starts a cloud machine by POST .../start (start_checked)")
    wait = inspect.unwrap(transport._wait_for_ready) if hasattr(transport, "_wait_for_ready") else None
    if wait is None or list(inspect.signature(wait).parameters) != [
            "base_url", "api_key", "machine_id", "timeout_s", "interval_s"]:
        problems.append("smol.transport._wait_for_ready(base_url, api_key, machine_id, timeout_s, interval_s) "
                        "is gone or changed shape (start_checked)")
    elif not all("_wait_for_ready" in inspect.getsource(method)
                 for method in (transport.CloudTransport.fork, transport.CloudTransport.fork_batch)):
        problems.append("CloudTransport.fork/fork_batch no longer wait through _wait_for_ready (start_checked)")
    resumable = getattr(transport, "_ResumableExec", None)
    if resumable is not None:  # 1.37.3 and later (exec_bounded)
        problems += [f"smol.transport._ResumableExec.{name} is gone (exec_bounded)"
                     for name in ("start", "pieces", "forget") if not callable(getattr(resumable, name, None))]
        made = inspect.getsource(resumable.__init__)
        if "self.cancelled" not in made or "self._body" not in made:
            problems.append("smol.transport._ResumableExec no longer has its cancelled event or its _body "
                            "(exec_bounded)")
        if not all("_ResumableExec(" in inspect.getsource(method)
                   for method in (transport.CloudTransport._exec_resumable, transport.CloudTransport.exec_stream)):
            problems.append("CloudTransport.exec/exec_stream no longer make a _ResumableExec (exec_bounded)")
    return problems
