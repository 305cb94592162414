"""One namespace guest as the host holds it: its init's socket, its scratch dir, its cgroups.

Exec and file requests go to the guest's init over ``channel``; destroy kills the init (and with
it the guest's pid namespace), then removes its cgroups and scratch dir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import secrets
import signal
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from pytest_smolvm import limits
from pytest_smolvm.backends.argv import ARG_HARD_LIMIT, argv_size, too_big
from pytest_smolvm.backends.base import (
    Cancel,
    EgressAttempt,
    GuestExecResult,
    OutputCallback,
)
from pytest_smolvm.backends.namespace import cgroups
from pytest_smolvm.backends.namespace import dns as _nsdns
from pytest_smolvm.backends.namespace import ledger as _nsledger
from pytest_smolvm.backends.namespace import network as _nsnet
from pytest_smolvm.backends.namespace.channel import Channel, Outcome, Unanswered, raise_error, run
from pytest_smolvm.backends.namespace.helper.stage import STAGE_PREFIX
from pytest_smolvm.backends.namespace.helper.writers import writers_for
from pytest_smolvm.backends.namespace.shell import SHELL_DOOR, bind_door, remove_door
from pytest_smolvm.baselines.baseline import Rootfs
from pytest_smolvm.errors import GuestError, ProvisionError
from pytest_smolvm.host.procs import process_start_time, wait_gone
from pytest_smolvm.untrusted.walk import rmtree

KILLED_BY_HOST = 128 + signal.SIGKILL  # a request's exit status when the host cancelled it

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
STREAM_BUFFER = 1 << 20


class NamespaceGuest:
    """One namespace guest. Calls from several threads run at once: each has its own channel."""

    def __init__(self, name: str, ctl: socket.socket, pid: int, scratch: Path,
                 cgroup_dirs: list[str], rootfs: Rootfs, spec_env: Mapping[str, str], *, cpus: float = 1) -> None:
        self.name = name
        self._channel = Channel(ctl, name, pid)
        self.pid = pid
        self.pid_start = process_start_time(pid)
        self.scratch = scratch
        self.cgroup_dirs = cgroup_dirs
        self._unpack_writers = writers_for(cpus)  # copy_in's, in the guest: as many as its CPUs allow
        self._oom_kills = 0  # the cgroup's OOM kill count after the last exec (a new cgroup has none)
        self._env = {**BASE_ENV, **rootfs.env, "HOSTNAME": name, **spec_env}
        self._spec_env_keys = set(spec_env)
        self.workdir = rootfs.workdir or "/"
        # The image config's User ("name", "uid", "name:group"): the user of every call that names
        # none. The group part is not honoured separately: the user's own groups apply.
        self.default_user = rootfs.user.split(":", 1)[0] or None
        self._destroyed = False
        self.kept = False
        self.nat: _nsnet.Nat | None = None  # pasta's watcher and the host's fence table, for network=True
        self.namespaces: dict[str, int] = {}  # its net (and user) namespace fds, for network=True
        self.dns: _nsdns.GuestDns | None = None  # its DNS proxy socket and names, for network=True
        self.upper_fd = -1  # its upper layer, a dir fd its setup sent (for vm.branch: branch.py)
        self.disk = "tmpfs"  # what its upper layer lives on: "ext4" (a disk lent to it alone) or "tmpfs" (disk.py)
        self.layers: list[Path] = []  # a branch's copies of its ancestors' files, above the baseline
        self.note = ""  # a line for its logs (a branch says what it did not carry)

    @property
    def oom_kills(self) -> int:
        """Processes the kernel killed for memory in this guest, as of its last exec: a fact the
        host read from the guest's cgroup, which a result line's ``cause`` may trust."""
        return self._oom_kills

    # ---------------------------------------------------------------- the Guest protocol

    def exec(self, argv: Sequence[str], *, env: Mapping[str, str], workdir: str | None,
             stdin: bytes | None, timeout: float | None, output_limit: int, user: str | None = None,
             on_output: OutputCallback | None = None, cancel: Cancel | None = None) -> GuestExecResult:
        full_env = {**self._env, **env}
        message: dict[str, Any] = {"op": "exec", "argv": list(argv), "env": full_env,
                                   "cwd": workdir or self.workdir}
        user = user if user is not None else self.default_user
        if user is not None:
            message["user"] = str(user)
            message["explicit"] = sorted({*self._spec_env_keys, *env})  # HOME etc. the caller set
        size = argv_size(argv, full_env)
        if size > ARG_HARD_LIMIT:
            raise too_big(size, min(os.sysconf("SC_ARG_MAX"), ARG_HARD_LIMIT), argv[0])
        out = self._run(message, stdin=stdin, output_limit=output_limit, timeout=timeout, on_output=on_output,
                        cancel=cancel)
        if out.error is not None:
            if out.error.get("errno") == errno.E2BIG:
                arg_max = out.error.get("arg_max")
                raise too_big(size, arg_max if isinstance(arg_max, int) else os.sysconf("SC_ARG_MAX"), argv[0])
            raise_error(out.error, self.name, "exec")
        before, self._oom_kills = self._oom_kills, cgroups.oom_kills(self.cgroup_dirs)
        return _noting_oom(GuestExecResult(out.exit_code, out.stdout, out.stderr, out.timed_out, out.truncated,
                                           out.cancelled), self._oom_kills - before)

    def _file_op(self, message: dict[str, Any], *, user: str | None, stdin: bytes | IO[bytes] | None = None,
                 stdout_sink: Callable[[bytes], None] | None = None, cancel: Cancel | None = None,
                 timeout: float | None = None, stdout_fd: int | None = None) -> None:
        timeout = timeout if timeout is not None else limits.LIMITS.guest_file_op  # read now, not at import
        user = user if user is not None else self.default_user
        if user is not None:
            message["user"] = str(user)
        result = self._run(message, stdin=stdin, output_limit=1 << 16, timeout=timeout, stdout_sink=stdout_sink,
                           cancel=cancel, stdout_fd=stdout_fd)
        if result.error is not None:
            raise_error(result.error, self.name, f"{message['op']} {message['path']}")
        if result.timed_out:  # a bound on every host-side read: a stalled or stalling guest side
            raise GuestError(f"{message['op']} {message['path']} in {self.name}: took longer than {timeout:.0f}s")
        # A cancelled op (the host's reader refused the stream, a cap) was killed: unless the
        # guest side had already failed on its own, when its reason says more than the reader's
        # ("empty stream"), whichever of the two the host happened to see first.
        if result.exit_code != 0 and not (result.cancelled and result.exit_code == KILLED_BY_HOST):
            detail = result.stderr.decode(errors="replace").strip().splitlines()
            raise GuestError(f"{message['op']} {message['path']} in {self.name}: "
                             f"{detail[-1] if detail else f'exit {result.exit_code}'}")

    def _run(self, message: dict[str, Any], **kwargs: Any) -> Outcome:
        """One request (``channel.run``); a wedged init (``Unanswered``) means the guest is given
        up: killed from here, its pid namespace with it, and the call raises one GuestError.
        What the guest leaves (cgroups, scratch dir, record) goes with its destroy, as after any
        init that died."""
        try:
            return run(self._channel, message, name=self.name, **kwargs)
        except Unanswered as exc:
            self._kill_init()
            raise GuestError(f"{exc}; the host killed the guest") from None

    def _kill_init(self) -> None:
        if process_start_time(self.pid) == self.pid_start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)  # SIGKILL ends a stopped or vfork-held init too
            wait_gone(self.pid, limits.LIMITS.destroy_one_namespace_guest)

    def write_file(self, path: str, data: bytes, mode: int | None, *, user: str | None = None) -> None:
        self._file_op({"op": "write", "path": path, "mode": mode}, user=user, stdin=data)

    def read_file(self, path: str, *, max_bytes: int | None = None, user: str | None = None) -> bytes:
        chunks: list[bytes] = []
        size = 0
        over = Cancel()

        def keep(data: bytes) -> None:
            nonlocal size
            size += len(data)
            if max_bytes is not None and size > max_bytes:
                over.cancel()  # kills the guest reader; nothing more is kept
            else:
                chunks.append(data)

        # "limit": the guest side refuses early too where it knows how (hardened file ops).
        self._file_op({"op": "read", "path": path, "limit": max_bytes}, user=user, stdout_sink=keep, cancel=over)
        if over.cancelled:
            raise OSError(errno.EFBIG, f"File too large: over read_file's max_bytes={max_bytes} "
                                       "(pass a larger max_bytes, or use copy_out)", path)
        return b"".join(chunks)

    def put_archive(self, guest_dir: str, produce: Callable[[IO[bytes]], None], *,
                    user: str | None = None) -> None:
        """Run the guest side's unpacker (``helper/unpack.py``) with ``produce`` writing its
        stdin from a thread.

        A socket, not a pipe, as in :meth:`_stream_out`: once the guest side has exited,
        shutting down our end wakes ``produce`` with a broken pipe, whatever else may hold the
        other end (no guest program is run to read it, so nothing should).
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(OSError):  # more in flight, fewer wake-ups (capped at net.core.wmem_max)
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER)
        errors: list[BaseException] = []

        def run_producer() -> None:
            try:
                with os.fdopen(ours.fileno(), "wb", closefd=False) as out:
                    produce(out)
                ours.shutdown(socket.SHUT_WR)  # the end of the archive, for the guest side
            except BrokenPipeError:
                pass  # the guest side stopped reading: its exit status says why
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append(exc)

        producer = threading.Thread(target=run_producer, daemon=True)
        producer.start()
        # A tree for a new guest_dir is unpacked under this name and moved in whole (the
        # guest side's ``stage.open_stage``); an unpacker killed on the way leaves it, and is followed up.
        stage = f"{STAGE_PREFIX}{secrets.token_hex(8)}"
        try:
            with theirs, os.fdopen(theirs.fileno(), "rb", closefd=False) as source:
                self._file_op({"op": "put_archive", "path": guest_dir, "writers": self._unpack_writers,
                               "stage": stage}, user=user, stdin=source)
        except Exception:
            with contextlib.suppress(Exception):
                self._file_op({"op": "discard_stage", "path": f"/{stage}"}, user=user,
                              timeout=limits.LIMITS.guest_stage_discard)
            raise
        finally:
            with contextlib.suppress(OSError):
                ours.shutdown(socket.SHUT_RDWR)
            producer.join()
            ours.close()
        if errors:
            raise errors[0]

    def get_archive(self, guest_path: str, arcname: str, consume: Callable[[IO[bytes]], None], *,
                    user: str | None = None) -> None:
        self._stream_out({"op": "get_archive", "path": guest_path, "arcname": arcname}, consume, user=user)

    def export_root(self, consume: Callable[[IO[bytes]], None]) -> None:
        """Stream the guest's root filesystem (mounts excluded) as a tar to ``consume``."""
        self._stream_out({"op": "export_root", "path": "/"}, consume)

    def _stream_out(self, message: dict[str, Any], consume: Callable[[IO[bytes]], None], *,
                    user: str | None = None) -> None:
        """Run a file op whose stdout is a stream, and hand that stream to ``consume`` in a thread.

        The guest side writes straight into the socket ``consume`` reads: no copy through this
        process's main thread, which would also contend with ``consume`` for the GIL. A socket,
        not a pipe: once the guest side has exited, everything it wrote is queued, and shutting
        down our end ends the stream there, even if a process the guest left behind (its own
        ``tar`` is the guest's to replace) still holds the other end.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(OSError):  # more in flight, fewer wake-ups (capped at net.core.wmem_max)
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER)
        errors: list[BaseException] = []
        stop = Cancel()

        def run_consumer() -> None:
            try:
                with os.fdopen(ours.fileno(), "rb", closefd=False) as source:
                    consume(source)
                    while source.read(1 << 16):
                        pass  # let the guest side finish even if the consumer stopped early
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append(exc)
                # The consumer refused the stream (a cap, a bad member): stop the guest side now
                # instead of letting it run on (a sparse terabyte would take hours).
                stop.cancel()

        consumer = threading.Thread(target=run_consumer, daemon=True)
        consumer.start()
        try:
            self._file_op(message, user=user, stdout_fd=theirs.detach(), cancel=stop)
        finally:
            with contextlib.suppress(OSError):
                ours.shutdown(socket.SHUT_RD)  # the reader gets what is queued, then the end
            consumer.join()
            ours.close()
        if errors:
            raise errors[0]
        if stop.cancelled:  # only a consumer that failed cancels
            raise GuestError(f"{message['op']} in {self.name}: the stream's reader stopped")

    def logs(self) -> str:
        # No console: its history is the exec transcript, and with the network, its egress ledger.
        note = self.note + "\n" if self.note else ""
        if not self.namespaces:
            return note
        try:
            return note + _nsledger.render_ledger(self.egress())
        except GuestError as exc:
            return note + str(exc)

    def egress(self) -> list[EgressAttempt]:
        if not self.namespaces or self._destroyed:
            return []
        try:
            names = self.dns.ledger() if self.dns is not None else []
            return _nsledger.read_ledger(self.namespaces, self.nat) + names
        except (ProvisionError, OSError, ValueError) as exc:
            raise GuestError(f"guest {self.name}: cannot read its egress ledger: {exc}") from exc

    def keep(self) -> None:
        """Let the guest outlive its owner, and open its shell door (see ``shell``): a socket
        in this guest's private scratch dir whose connections the init serves like its owner's."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, bind_door(self.scratch) as door:
            try:
                self._channel.send({"op": "keep"}, [theirs.fileno(), door.fileno()])
            finally:
                theirs.close()
            ours.settimeout(limits.LIMITS.destroy_one_namespace_guest)
            if not ours.recv(4096):
                raise GuestError(f"guest {self.name} is gone (its init exited)")
        self.kept = True
        # A kept guest is not branched; its upper fd would keep two of its dirs on its disk after
        # the guest is reaped, and the helper would drop the disk rather than lend it again.
        self._close_upper()

    def _close_upper(self) -> None:
        if self.upper_fd >= 0:
            os.close(self.upper_fd)
            self.upper_fd = -1

    def registry_data(self) -> dict[str, Any]:
        data = {"pid": self.pid, "pid_start": self.pid_start, "scratch": str(self.scratch),
                "cgroups": self.cgroup_dirs}
        if self.kept:
            data["shell_door"] = SHELL_DOOR
        return data

    def destroy(self) -> None:
        if self._destroyed:
            return
        # First: an ext4 disk goes back to the helper's pool when the init is gone, and is
        # cleaned only if nothing of the guest's is held then (helper/disk.py).
        self._close_upper()
        self._channel.close()
        destroy_recorded(self.registry_data())  # may raise; a retry starts over
        if self.nat is not None:
            _nsnet.stop_nat(self.nat)  # exiting by itself already: the guest's init is gone
        if self.dns is not None:
            _nsdns.stop(self.dns)
            self.dns = None
        for fd in self.namespaces.values():
            os.close(fd)
        self.namespaces = {}
        self._destroyed = True


def _noting_oom(result: GuestExecResult, kills: int) -> GuestExecResult:
    """Say so on stderr when the kernel killed processes for memory during this exec."""
    if kills <= 0:
        return result
    note = (f"\npytest-smolvm: the guest ran out of memory: the kernel killed {kills} process(es) "
            "(OOM; raise memory_mb in @pytest.mark.smol)\n").encode()
    return dataclasses.replace(result, stderr=result.stderr + note)


def destroy_recorded(data: Mapping[str, Any]) -> None:
    """Kill a guest's init (the kernel then kills its whole pid namespace) and remove what is left."""
    pid = int(data.get("pid") or 0)
    if pid and process_start_time(pid) == data.get("pid_start"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not wait_gone(pid, limits.LIMITS.destroy_one_namespace_guest):
            raise GuestError(f"guest init {pid} did not exit within "
                             f"{limits.LIMITS.destroy_one_namespace_guest:.0f}s of SIGKILL")
    elif not pid:
        # Recorded before create returned (see reserve): whatever runs in the
        # guest's own cgroup is that guest's, half made.
        for path in data.get("cgroups") or []:
            cgroups.kill_members(path)
    for path in data.get("cgroups") or []:
        cgroups.remove(path)
    scratch = data.get("scratch")
    if scratch:
        remove_door(scratch)
        try:
            os.rmdir(scratch)  # only an empty mount point: the guest's files lived on its disk, in its mount ns
        except FileNotFoundError:
            pass
        layer = Path(scratch).parent.parent / "layers" / Path(scratch).name  # a branch's copy of its parent
        if layer.is_dir() and not layer.is_symlink():
            rmtree(layer)
