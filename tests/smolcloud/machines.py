"""The machines a loopback smol cloud holds, each backed by a namespace guest of this project.

A machine is booted from a *lower*: an image's unpacked rootfs, or a snapshot of another
machine's root (a branch, or a stopped machine's disk). A snapshot is the source's root as
``NamespaceGuest.export_root`` streams it, unpacked with ``baseline.apply_layer`` into a
directory that every child overlays read-only (copy-on-write, as the namespace backend's warm
baselines do). Snapshots are reference-counted and removed when the last machine on them goes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import itertools
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pytest_smolvm.backends.base import Cancel, OutputCallback, VMSpec
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.backends.namespace.guest import NamespaceGuest
from pytest_smolvm.baselines.archive import apply_layer
from pytest_smolvm.baselines.baseline import Baseline
from pytest_smolvm.baselines.cache import force_rmtree
from pytest_smolvm.errors import GuestError, GuestUserError, ProvisionError, SmolVMError
from tests.smolcloud import wire
from tests.smolcloud.faults import Faults

OUTPUT_CAP = 32 << 20  # per stream: the server's own bound on what one exec may return
LOG_LINES = 1000
DEFAULT_DISK_MB = 2048
BOOT_THREADS = 8  # a batch's branches booted side by side
HALT_WAIT = 10.0  # seconds a halt waits for in-flight calls to notice their guest is gone
BACKGROUND = '"$@" </dev/null >/dev/null 2>&1 & echo "pid=$!"'
# A resumable exec's unread output the node keeps (both streams together): past it the oldest
# unread bytes are dropped and the next read reports them ``lost``, so whatever a guest prints,
# an exec costs the server this much. The SDK's slow reader is ExecStream's consumer.
EXEC_BUFFER = 8 << 20
EXEC_CHUNKS = 1 << 16  # pieces kept at most: tiny writes alternating between streams cost no more
EXEC_MERGE = 64 << 10  # consecutive writes to one stream share a piece up to this size
EXEC_ANSWER = 1 << 20  # output one answer carries at most (this server's choice): the SDK reads on
FINISHED_EXECS = 32  # finished resumable execs a machine keeps for clients that never deleted them
FINISHED_EXEC_TTL = 600.0  # seconds a finished one is kept (scaled by --ttl-scale)
# output_limit of the guest's own copy of a resumable exec's output: every byte went through
# on_output into the exec's buffer already, so the copy is not kept.
EXEC_GUEST_COPY = 2


class ResumableExec:
    """One resumable exec on a machine's node: the command's output as one byte sequence across
    both streams (offsets count from its first byte), of which at most ``EXEC_BUFFER`` unread
    bytes are kept, and its end."""

    def __init__(self, exec_id: str) -> None:
        self.id = exec_id
        self.cancel = Cancel()
        self.changed = threading.Condition()
        self._pieces: collections.deque[tuple[str, int, bytearray]] = collections.deque()
        self.base = 0  # offset of the first byte kept (what came before was read, or dropped)
        self.end = 0  # offset past the last byte the command wrote
        self.done = False
        self.exit_code: int | None = None
        self.failure: wire.ApiError | None = None  # the command could not finish
        self.ended_at = 0.0

    def add(self, stream: str, data: bytes) -> None:
        """``on_output``: never blocks the command; the oldest unread output goes instead."""
        with self.changed:
            last = self._pieces[-1] if self._pieces else None
            if last is not None and last[0] == stream and len(last[2]) < EXEC_MERGE:
                last[2].extend(data)
            else:
                self._pieces.append((stream, self.end, bytearray(data)))
            self.end += len(data)
            self._drop(self.end - EXEC_BUFFER)
            while len(self._pieces) > EXEC_CHUNKS:
                self._drop(self._pieces[1][1])
            self.changed.notify_all()

    def release(self, offset: int) -> None:
        """The client has the output before ``offset``: the node need not keep it."""
        with self.changed:
            self._past_end(offset)
            self._drop(offset)

    def _past_end(self, offset: int) -> None:
        if offset > self.end:
            raise wire.bad_request(f"execs: after={offset} is past the output's end ({self.end})")

    def _drop(self, offset: int) -> None:
        while self._pieces and self.base < offset:
            stream, start, data = self._pieces[0]
            if start + len(data) <= offset:
                self._pieces.popleft()
            else:
                self._pieces[0] = (stream, offset, data[offset - start:])
            self.base = min(offset, start + len(data))
        self.base = max(self.base, offset)

    def finish(self, exit_code: int | None, failure: wire.ApiError | None = None) -> None:
        with self.changed:
            self.done, self.exit_code, self.failure = True, exit_code, failure
            self.ended_at = time.monotonic()
            self.changed.notify_all()

    def wait(self, after: int, seconds: float) -> None:
        """Until there is output past ``after``, or the end, or ``seconds`` have passed."""
        with self.changed:
            self.changed.wait_for(lambda: self.end > after or self.done, timeout=seconds)

    def start_failure(self) -> wire.ApiError | None:
        """What its start answers instead: a failure before any output, by the time the start is
        answered (unknown user, bad cwd, the machine stopped under it), as the plain exec's status
        for the same case. A later one is the exec's end: exitCode null and its error."""
        with self.changed:
            return self.failure if self.done and self.failure is not None and self.end == 0 else None

    def answer(self, after: int) -> dict[str, Any]:
        with self.changed:
            self._past_end(after)
            lost = (after, self.base) if after < self.base else None
            at = max(after, self.base)
            output: list[tuple[str, int, bytes]] = []
            for stream, start, data in self._pieces:
                room = EXEC_ANSWER - (at - max(after, self.base))
                if room <= 0:
                    break
                if start + len(data) <= at:
                    continue
                piece = bytes(data[at - start:at - start + room])
                output.append((stream, at, piece))
                at += len(piece)
            done = self.done and at == self.end
            failure = self.failure.message if self.failure is not None else None
            return wire.exec_answer(self.id, output, at, done, self.exit_code, failure, lost)


class Lower:
    """A read-only root machines boot from; a snapshot one is deleted with its last user."""

    def __init__(self, baseline: Baseline, directory: Path | None = None) -> None:
        self.baseline = baseline
        self.directory = directory  # None: an image's cache entry, never deleted here
        self.users = 0

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0 and self.directory is not None:
            force_rmtree(self.directory)


@dataclass
class Machine:
    id: str
    name: str
    owner: str
    image: str
    request: dict[str, Any]  # the create body as received (for the admin view)
    labels: dict[str, str]
    cpus: int | None
    memory_mb: int | None
    disk_gb: int | None
    network: wire.Network
    forkable: bool
    ttl_seconds: int | None
    auto_stop_seconds: int | None
    lower: Lower
    source_id: str | None = None
    created_at: float = field(default_factory=time.time)
    state: str = "created"
    guest: NamespaceGuest | None = None
    started_at: float = 0.0
    last_activity: float = field(default_factory=time.monotonic)
    frozen: bool = False
    generation: int = 0  # bumped by anything that may change the root (exec, file put)
    snapshot: tuple[int, Lower] | None = None
    children: set[str] = field(default_factory=set)
    log: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=LOG_LINES))
    op_lock: threading.Lock = field(default_factory=threading.Lock)
    busy: int = 0  # guest calls in flight (exec, files): a halt waits for them to notice
    idle: threading.Condition = field(default_factory=threading.Condition)
    execs: dict[str, ResumableExec] = field(default_factory=dict)  # by execId; they go with the machine
    execs_lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        with self.idle:
            self.busy += 1
        try:
            yield
        finally:
            with self.idle:
                self.busy -= 1
                self.idle.notify_all()

    def say(self, line: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        self.log.append(f"{stamp} {line}")

    def expired(self, now: float, scale: float) -> bool:
        return self.ttl_seconds is not None and now >= self.created_at + self.ttl_seconds * scale


def file_error(path: str, exc: BaseException) -> wire.ApiError:
    """A guest's refusal of a file operation: 404 when the path is not there, else a 400."""
    if isinstance(exc, FileNotFoundError) or (isinstance(exc, GuestError) and "No such file" in str(exc)):
        return wire.not_found(f"file {path}")
    name = errno.errorcode.get(exc.errno or 0, "EIO") if isinstance(exc, OSError) else "EIO"
    return wire.ApiError(413 if name == "EFBIG" else 400, f"file_{name.lower()}", f"{path}: {exc}")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


class Store:
    def __init__(self, images: dict[str, Baseline], work: Path, faults: Faults,
                 ready_delay: float = 0.0, ttl_scale: float = 1.0, untimed_execs: bool = False,
                 execs_ignore_user: bool = False) -> None:
        self.images = images
        self.untimed_execs = untimed_execs  # resumable execs run without their timeoutSeconds
        self.execs_ignore_user = execs_ignore_user  # ... and as the image's default account
        self.work = work
        self.faults = faults
        self.ready_delay = ready_delay
        self.ttl_scale = ttl_scale  # < 1 runs TTLs faster, for tests of what a TTL does
        self.history: list[dict[str, Any]] = []  # every accepted create and branch, for tests
        self.backend = NamespaceBackend()
        self.lock = threading.RLock()
        self.machines: dict[str, Machine] = {}
        self._image_lowers: dict[str, Lower] = {}
        self._seq = itertools.count(1)
        self.closed = False

    # ------------------------------------------------------------------ lookup

    def get(self, owner: str, machine_id: str) -> Machine:
        with self.lock:
            machine = self.machines.get(machine_id)
        if machine is None or machine.owner != owner:
            raise wire.not_found(f"machine {machine_id}")
        return machine

    def listing(self, owner: str, labels: dict[str, str]) -> list[Machine]:
        with self.lock:
            mine = [m for m in self.machines.values() if m.owner == owner]
        return [m for m in mine if all(m.labels.get(k) == v for k, v in labels.items())]

    def _name_taken(self, owner: str, name: str) -> bool:
        return any(m.owner == owner and m.name == name for m in self.machines.values())

    # ------------------------------------------------------------------ create, start, stop

    def create(self, owner: str, request: wire.CreateRequest) -> Machine:
        self.faults.check("create")
        image = self.images.get(request.image)
        if image is None:
            raise wire.ApiError(400, "image_not_found", f"image {request.image!r} is not known to this "
                                f"server (known: {', '.join(sorted(self.images))})")
        machine_id = f"mach-{uuid.uuid4().hex[:20]}"
        with self.lock:
            if self.closed:
                raise wire.ApiError(503, "shutting_down", "the server is shutting down", retryable=False)
            name = request.name or machine_id
            if self._name_taken(owner, name):
                raise wire.conflict(f"a machine named {name!r} already exists")
            lower = self._image_lowers.setdefault(request.image, Lower(image))
            lower.users += 1
            machine = Machine(id=machine_id, name=name, owner=owner, image=request.image, request=request.raw,
                              labels=request.labels, cpus=request.cpus, memory_mb=request.memory_mb,
                              disk_gb=request.disk_gb, network=request.network, forkable=request.forkable,
                              ttl_seconds=request.ttl_seconds, auto_stop_seconds=request.auto_stop_seconds,
                              lower=lower)
            self.machines[machine_id] = machine
            self.history.append({"op": "create", "id": machine_id, "owner": owner, "request": request.raw})
        machine.say(f"created {name} from image {request.image}")
        return machine

    def start(self, machine: Machine) -> None:
        self.faults.check("start")
        with machine.op_lock:
            if machine.state == "started":
                return  # start is idempotent (transport.py:1766-1773 sends it idempotent=True)
            if machine.state == "deleted":
                raise wire.not_found(f"machine {machine.id}")
            machine.guest = self._boot(machine)
            machine.state, machine.started_at = "started", time.monotonic()
            machine.last_activity = time.monotonic()
            machine.say("started")

    def _boot(self, machine: Machine) -> NamespaceGuest:
        disk_mb = machine.disk_gb * 1024 if machine.disk_gb else DEFAULT_DISK_MB
        spec = VMSpec(name=f"{machine.id}-{next(self._seq)}", baseline=machine.lower.baseline,
                      cpus=machine.cpus, memory_mb=machine.memory_mb, disk_mb=disk_mb,
                      # The service's three egress modes (transport.py:2918-2931), each enforced by
                      # the namespace guest: open is NAT, blocked is none, allowCidrs is its allowlist.
                      network=machine.network.mode == "open",
                      allow_hosts=(*machine.network.cidrs, *machine.network.hosts)
                      if machine.network.mode == "allowCidrs" else ())
        try:
            return self.backend.create(spec)
        except (ProvisionError, OSError) as exc:
            raise wire.ApiError(503, "boot_failed", f"could not boot {machine.id}: {exc}", retryable=True) from exc

    def stop(self, machine: Machine) -> None:
        with machine.op_lock:
            if machine.state != "started":
                return
            if machine.children:
                raise wire.conflict(f"{machine.id} has live branches; delete them first")
            disk = self._snapshot(machine)  # the disk survives a stop; RAM does not
            disk.users += 1
            machine.lower.release()
            machine.lower = disk  # the cached snapshot stays valid: it is this very root
            self._halt(machine, "stopped")
            machine.say("stopped")

    def _halt(self, machine: Machine, state: str) -> None:
        guest, machine.guest = machine.guest, None
        machine.state = state
        if guest is None:
            return
        # Kill the init first: calls in flight then see their guest gone and answer. Closing the
        # control socket under them instead would leave them polling a dead descriptor.
        with contextlib.suppress(ProcessLookupError):
            os.kill(guest.pid, signal.SIGKILL)
        with machine.idle:
            machine.idle.wait_for(lambda: machine.busy == 0, timeout=HALT_WAIT)
        guest.destroy()

    def ready(self, machine: Machine) -> bool:
        return machine.state == "started" and time.monotonic() >= machine.started_at + self.ready_delay

    # ------------------------------------------------------------------ delete

    def delete(self, machine: Machine, *, cascade: bool = False, inject: bool = True) -> None:
        if inject:
            self.faults.check("delete")
        if cascade:
            for child_id in list(machine.children):
                with self.lock:
                    child = self.machines.get(child_id)
                if child is not None:
                    self.delete(child, cascade=True, inject=inject)
        with machine.op_lock:
            if machine.state == "deleted":
                return
            if machine.children:
                # As the engine says: "the fork base of N live clone(s) ... delete the clones first"
                raise wire.conflict(f"{machine.id} is the branch source of {len(machine.children)} live "
                                    "machine(s); delete them first")
            with self.lock:
                self.machines.pop(machine.id, None)
                source = self.machines.get(machine.source_id or "")
                if source is not None:
                    source.children.discard(machine.id)
            try:
                self._halt(machine, "deleted")
            finally:
                with machine.execs_lock:
                    machine.execs.clear()  # their commands ended with the guest
                machine.lower.release()
                if machine.snapshot is not None:
                    machine.snapshot[1].release()
                    machine.snapshot = None

    # ------------------------------------------------------------------ exec and files

    def running(self, machine: Machine, what: str) -> NamespaceGuest:
        guest = machine.guest
        if machine.state != "started" or guest is None:
            raise wire.conflict(f"{what}: machine {machine.id} is {machine.state}, not started")
        if machine.frozen:
            raise wire.conflict(f"{what}: machine {machine.id} is a frozen branch source and runs no commands")
        machine.last_activity = time.monotonic()
        return guest

    def exec(self, machine: Machine, request: wire.ExecRequest, on_output: OutputCallback | None = None,
             cancel: Cancel | None = None, *, inject: bool = True,
             output_limit: int = OUTPUT_CAP) -> tuple[int, bytes, bytes, bool]:
        if inject:
            self.faults.check("exec")
        guest = self.running(machine, "exec")
        argv = request.argv
        if request.background:
            argv = ["/bin/sh", "-c", BACKGROUND, "sh", *argv]
        machine.generation += 1
        try:
            with machine.using():
                result = guest.exec(argv, env=request.env, workdir=request.cwd, stdin=request.stdin,
                                    timeout=request.timeout, output_limit=output_limit, user=request.user,
                                    on_output=on_output, cancel=cancel)
        except GuestUserError as exc:
            raise wire.ApiError(400, "unknown_user", f"exec in {machine.id}: {exc}") from exc
        except OSError as exc:
            if request.cwd and exc.filename == request.cwd:
                raise wire.ApiError(400, "bad_workdir", f"exec in {machine.id}: cannot enter {request.cwd}: "
                                    f"{exc.strerror}") from exc
            # A program that cannot start: what a shell (and so, presumably, the agent) reports.
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            message = f"{argv[0]}: {exc.strerror or exc}\n".encode()
            if on_output is not None:  # a stream's reader sees it as a plain exec's stderr has it
                on_output("stderr", message)
            return code, b"", message, True
        except GuestError as exc:
            if machine.state != "started":
                raise wire.interrupted(f"exec in {machine.id} was interrupted: the machine is "
                                       f"{machine.state}") from exc
            raise wire.ApiError(500, "exec_failed", f"exec in {machine.id}: {exc}") from exc
        finally:
            machine.last_activity = time.monotonic()
        complete = len(result.stdout) < OUTPUT_CAP and len(result.stderr) < OUTPUT_CAP
        return result.exit_code, result.stdout, result.stderr, complete

    # ------------------------------------------------------------------ resumable execs

    def exec_start(self, machine: Machine, start: wire.ExecStart) -> ResumableExec:
        """The exec ``start.exec_id`` names, started now in a thread of its own, unless a start
        of that id came before (a retried start is the same start: nothing more is run)."""
        with machine.execs_lock:
            known = machine.execs.get(start.exec_id)
        if known is not None:
            return known
        self.faults.check("exec")  # a start is an exec, as the plain one is; a read is not
        self.running(machine, "exec")
        record = ResumableExec(start.exec_id)
        with machine.execs_lock:
            known = machine.execs.setdefault(start.exec_id, record)
        if known is not record:  # the same start, twice at once
            return known
        self._expire_execs(machine)
        threading.Thread(target=self._run_exec, args=(machine, record, start.request), daemon=True,
                         name=f"exec-{machine.id}-{record.id[:8]}").start()
        return record

    def _run_exec(self, machine: Machine, record: ResumableExec, request: wire.ExecRequest) -> None:
        if self.untimed_execs:  # a node whose agent never enforced a timeout: only the client's kill ends it
            request = dataclasses.replace(request, timeout=None)
        if self.execs_ignore_user:  # a plane that ignores the field: the SDK checks no echo here
            request = dataclasses.replace(request, user=None)
        try:
            code, _out, _err, _complete = self.exec(machine, request, record.add, record.cancel, inject=False,
                                                    output_limit=EXEC_GUEST_COPY)
        except wire.ApiError as exc:
            record.finish(None, exc)
        except Exception as exc:
            record.finish(None, wire.ApiError(500, "exec_failed", f"exec in {machine.id}: {type(exc).__name__}: "
                                              f"{exc}"))
        else:
            record.finish(code)

    def exec_record(self, machine: Machine, exec_id: str) -> ResumableExec:
        with machine.execs_lock:
            record = machine.execs.get(exec_id)
        if record is None:
            raise wire.not_found(f"exec {exec_id} of machine {machine.id}")
        return record

    def exec_forget(self, machine: Machine, exec_id: str) -> None:
        """Kill the command if it still runs, and forget it."""
        with machine.execs_lock:
            record = machine.execs.pop(exec_id, None)
        if record is None:
            raise wire.not_found(f"exec {exec_id} of machine {machine.id}")
        record.cancel.cancel()

    def forget_abandoned(self, machine: Machine, record: ResumableExec) -> None:
        """A start answered with its failure instead: there is no exec to read."""
        with machine.execs_lock:
            if machine.execs.get(record.id) is record:
                del machine.execs[record.id]

    def _expire_execs(self, machine: Machine) -> None:
        """Finished execs no client deleted: past FINISHED_EXEC_TTL, or past the FINISHED_EXECS newest."""
        now = time.monotonic()
        with machine.execs_lock:
            finished = sorted((r for r in machine.execs.values() if r.done), key=lambda r: r.ended_at)
            for index, record in enumerate(finished):
                if index < len(finished) - FINISHED_EXECS or now - record.ended_at > \
                        FINISHED_EXEC_TTL * self.ttl_scale:
                    del machine.execs[record.id]

    def read_file(self, machine: Machine, path: str) -> bytes:
        guest = self.running(machine, "read file")
        try:
            with machine.using():
                data = guest.read_file(path, max_bytes=wire.MAX_FILE_BYTES)
        except (GuestError, OSError) as exc:
            raise file_error(path, exc) from exc
        if len(data) > wire.MAX_FILE_BYTES:
            raise wire.ApiError(413, "file_too_large", f"{path} is larger than the 100 MiB file limit")
        return data

    def write_file(self, machine: Machine, path: str, data: bytes) -> None:
        guest = self.running(machine, "write file")
        if len(data) > wire.MAX_FILE_BYTES:
            raise wire.ApiError(413, "file_too_large", f"{path}: files are limited to 100 MiB")
        parent = path.rsplit("/", 1)[0] or "/"
        # Strict on purpose: nothing says the real service creates parent directories
        # (the SDK's integrations mkdir -p first), so a missing parent is refused here.
        machine.generation += 1
        try:
            with machine.using():
                check = guest.exec(["/bin/sh", "-c", '[ -d "$1" ] && [ ! -d "$2" ]', "sh", parent, path],
                                   env={}, workdir=None, stdin=None, timeout=30, output_limit=1024)
                if check.exit_code != 0:
                    raise wire.not_found(f"directory {parent} (or {path} is a directory)")
                guest.write_file(path, data, None)
        except (GuestError, OSError) as exc:
            raise file_error(path, exc) from exc

    # ------------------------------------------------------------------ branches

    def branch(self, owner: str, source: Machine, request: wire.BranchRequest) -> list[Machine]:
        unready = self.faults.check("branch")
        with source.op_lock:
            if not source.forkable:
                raise wire.conflict(f"{source.id} was not created forkable, so it has no copy-on-write "
                                    "state to branch from")
            if source.state != "started":
                raise wire.conflict(f"{source.id} is {source.state}; only a started machine can branch")
            with self.lock:
                taken = [n for n in request.names if self._name_taken(owner, n)]
            if taken:
                raise wire.conflict(f"machine name(s) already exist: {', '.join(taken)}")
            lower = self._snapshot(source)
            call = uuid.uuid4().hex[:12]  # one id per request: history tells batched calls apart
            # Registered under the source's lock, so that a delete or stop of the source meanwhile
            # conflicts; booted outside it, side by side. Booted one after another under the lock,
            # every branch of a source waited for the one before: creates were capped at one
            # namespace boot's pace (~30 a second here), a limit of this stand and not of the
            # service, which the concurrency benchmarks then measured instead of the plugin.
            children = [self._register_child(owner, source, name, lower, request.branchable, call)
                        for name in request.names]
        if unready:  # stuck booting (--fail branch:N:unready): answered, never started
            return children
        try:
            with ThreadPoolExecutor(max_workers=min(len(children), BOOT_THREADS)) as pool:
                for _ in pool.map(self._boot_child, children):
                    pass
        except BaseException:
            for child in reversed(children):  # transactional: every child or none
                self.delete(child, inject=False)
            raise
        for child in children:
            source.say(f"branched {child.id} ({child.name})")
        if request.freeze_source:
            with source.op_lock:
                source.frozen = True
                source.say("frozen as a branch base")
        return children

    def _register_child(self, owner: str, source: Machine, name: str, lower: Lower, branchable: bool,
                        call: str = "") -> Machine:
        child = Machine(id=f"mach-{uuid.uuid4().hex[:20]}", name=name, owner=owner, image=source.image,
                        request={"branchOf": source.id, "name": name}, labels=dict(source.labels),
                        cpus=source.cpus, memory_mb=source.memory_mb, disk_gb=source.disk_gb,
                        network=source.network, forkable=branchable, ttl_seconds=source.ttl_seconds,
                        auto_stop_seconds=source.auto_stop_seconds, lower=lower, source_id=source.id)
        lower.users += 1
        with self.lock:
            self.machines[child.id] = child
            source.children.add(child.id)
            self.history.append({"op": "branch", "id": child.id, "owner": owner, "source": source.id,
                                 "name": name, "call": call})
        return child

    def _boot_child(self, child: Machine) -> None:
        with child.op_lock:
            if child.state == "deleted":
                raise wire.not_found(f"machine {child.id}")
            child.guest = self._boot(child)
            child.state, child.started_at = "started", time.monotonic()
        child.say(f"branched from {child.source_id}")

    def _snapshot(self, machine: Machine) -> Lower:
        """The machine's root now, as a lower; reused while nothing could have changed it."""
        if machine.snapshot is not None and machine.snapshot[0] == machine.generation:
            return machine.snapshot[1]
        if machine.generation == 0:
            # Nothing has run in it and nothing was put in it: its root is the lower it booted
            # from, plus what every boot writes (a child's boot writes its own). Exporting and
            # unpacking that root took 0.7 s per source here, where the service's copy-on-write
            # snapshot takes next to none: a cost of this stand that the concurrency benchmark
            # then measured before each run's first guest.
            machine.lower.users += 1  # the machine's own cache holds one reference
            machine.snapshot = (0, machine.lower)
            return machine.lower
        guest = machine.guest
        assert guest is not None
        directory = self.work / f"snap-{machine.id}-{machine.generation}-{uuid.uuid4().hex[:6]}"
        (directory / "rootfs").mkdir(parents=True)
        try:
            guest.export_root(lambda stream: apply_layer(stream, directory / "rootfs", squash_owner=False))
        except (SmolVMError, OSError) as exc:
            force_rmtree(directory)
            raise wire.ApiError(500, "snapshot_failed", f"could not snapshot {machine.id}: {exc}") from exc
        lower = Lower(Baseline(f"snapshot of {machine.id}", "rootfs-dir", directory / "rootfs",
                               f"sha256:{uuid.uuid4().hex}"), directory)
        machine.say(f"root copied as a snapshot (generation {machine.generation})")
        lower.users += 1  # the machine's own cache holds one reference
        if machine.snapshot is not None:
            machine.snapshot[1].release()
        machine.snapshot = (machine.generation, lower)
        return lower

    # ------------------------------------------------------------------ expiry and shutdown

    def reap(self) -> list[str]:
        """Delete machines past their TTL (with their branches) and stop idle ones."""
        now, mono = time.time(), time.monotonic()
        with self.lock:
            machines = list(self.machines.values())
        removed = []
        for machine in machines:
            self._expire_execs(machine)
            try:
                if machine.expired(now, self.ttl_scale):
                    machine.say(f"TTL of {machine.ttl_seconds}s expired: deleting")
                    self.delete(machine, cascade=True)
                    removed.append(machine.id)
                elif machine.auto_stop_seconds and machine.state == "started" and not machine.children \
                        and mono - machine.last_activity > machine.auto_stop_seconds:
                    self.stop(machine)
            except wire.ApiError:
                continue  # an injected or transient failure: the next pass tries again
        return removed

    def close(self) -> None:
        with self.lock:
            self.closed = True
            roots = [m for m in self.machines.values() if m.source_id not in self.machines]
        for machine in roots:
            try:
                self.delete(machine, cascade=True, inject=False)
            except (wire.ApiError, SmolVMError):
                pass
        self.backend.close()
        shutil.rmtree(self.work, ignore_errors=True)
