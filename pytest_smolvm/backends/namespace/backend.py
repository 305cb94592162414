"""The namespace backend: Linux namespaces + overlayfs, for hosts where no microVM boots.

Each guest is a pid-1 init (see ``helper/``) in fresh mount/pid/net/uts/ipc namespaces
(plus a user namespace when not root) whose root is an overlay of the baseline rootfs and a
per-guest tmpfs upper layer. It shares the host kernel: weaker isolation than a microVM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import importlib.machinery
import json
import marshal
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any, ClassVar

from pytest_smolvm.backends.base import (
    BackendOptions,
    Cancel,
    Guest,
    GuestExecResult,
    OutputCallback,
    ProbeResult,
    VMSpec,
)
from pytest_smolvm.backends.namespace import cgroups, seccomp
from pytest_smolvm.backends.namespace import network as _nsnet
from pytest_smolvm.backends.namespace.channel import ARG_HARD_LIMIT, Channel, argv_size, raise_error, run, too_big
from pytest_smolvm.baselines.archive import apply_layer
from pytest_smolvm.baselines.baseline import Baseline, Rootfs
from pytest_smolvm.baselines.cache import prepare_derived, unpack
from pytest_smolvm.errors import GuestError, ProvisionError, UsageError
from pytest_smolvm.host.paths import runtime_dir
from pytest_smolvm.host.procs import process_start_time, wait_gone

HELPER_DIR = Path(__file__).with_name("helper")
HELPER_PACKAGE = "pytest_smolvm.backends.namespace.helper"
# argv[1] of every helper and guest init: how the leak checks and the reaper tell our helpers apart.
HELPER_ARGV_NAME = "_nsguest.py"
# The helper's code comes on stdin, compiled: its argv (every guest reads it as /proc/1/cmdline)
# and its environment (the guest cannot read it: the helper is not dumpable) carry no host path.
HELPER_ARGV0 = "pytest-smolvm-nsguest"
# Load the helper's modules in order under their own names (so they import each other from
# sys.modules, never from a path), then run the zygote.
HELPER_BOOT = ("import sys,marshal,types\n"
               "for n,c in marshal.loads(sys.stdin.buffer.read()):\n"
               " m=types.ModuleType(n);sys.modules[n]=m;exec(c,m.__dict__)\n"
               "m.main()")
HELPER_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
FILE_OP_TIMEOUT = 900.0  # seconds for one file operation in the guest (a FIFO, a stalled helper)
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
MAX_MESSAGE = 1 << 20
STREAM_BUFFER = 1 << 20
DESTROY_TIMEOUT = 10.0


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 8)
    if not data:
        return None, list(fds)
    return json.loads(data), list(fds)


@functools.lru_cache(maxsize=1)
def helper_code() -> bytes:
    """The helper's modules, compiled and marshalled for a zygote to load (see HELPER_BOOT).

    Compiled by importlib's own loader: from the package's bytecode cache when that is fresh
    (pip writes it at install), else from source, because compiling the helper in every zygote
    would be on each worker's way to its first guest. The zygote runs this same interpreter
    (sys.executable), so the marshal format is its own.
    """
    from pytest_smolvm.backends.namespace.helper import MODULES

    codes = []
    for module in MODULES:
        name = f"{HELPER_PACKAGE}.{module}"
        path = str(HELPER_DIR / f"{module}.py")
        codes.append((name, importlib.machinery.SourceFileLoader(name, path).get_code(name)))
    return marshal.dumps(codes)


class Zygote:
    """The per-process helper that forks guests (started lazily, once)."""

    def __init__(self, state_tag: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The state dir's tag in argv names whose helper (and whose guests' inits) a process is.
        self._proc = subprocess.Popen(
            [HELPER_ARGV0, "-I", "-S", "-c", HELPER_BOOT, HELPER_ARGV_NAME, str(theirs.fileno()), state_tag],
            executable=sys.executable, env=HELPER_ENV, pass_fds=[theirs.fileno()], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        assert self._proc.stdin is not None
        with self._proc.stdin:
            self._proc.stdin.write(helper_code())
        self._sock = ours
        self._send_lock = threading.Lock()
        # Replies come in the order guests finish, not the order asked: whoever waits reads
        # for everyone (one reader at a time) and hands each reply to its asker.
        self._replies: dict[int, tuple[dict[str, Any], list[int]]] = {}
        self._reading = False
        self._arrived = threading.Condition()
        self._next_id = 0
        self.dead = False

    def tell(self, message: dict[str, Any]) -> None:
        """Send ``message`` with no reply to wait for (messages arrive in the order sent)."""
        with self._send_lock:
            try:
                _send(self._sock, message)
            except OSError:
                self.dead = True

    def request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        with self._send_lock:
            self._next_id += 1
            ident = self._next_id
            try:
                _send(self._sock, {**message, "id": ident})
            except OSError:
                self.dead = True
        with self._arrived:
            while ident not in self._replies and not self.dead:
                if self._reading:
                    self._arrived.wait()
                    continue
                self._reading = True
                self._arrived.release()
                try:
                    try:
                        reply, fds = _recv(self._sock)
                    except OSError:
                        reply, fds = None, []
                finally:
                    self._arrived.acquire()
                    self._reading = False
                if reply is None:
                    self.dead = True
                else:
                    self._replies[int(reply.get("id") or 0)] = (reply, fds)
                self._arrived.notify_all()
            if ident in self._replies:
                return self._replies.pop(ident)
        raise ProvisionError(f"the namespace helper died (exit status {self._proc.poll()})", retryable=True)

    def close(self) -> None:
        self._sock.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class NamespaceGuest:
    """One namespace guest. Calls from several threads run at once: each has its own channel."""

    def __init__(self, name: str, ctl: socket.socket, pid: int, scratch: Path,
                 cgroup_dirs: list[str], rootfs: Rootfs, spec_env: Mapping[str, str]) -> None:
        self.name = name
        self._channel = Channel(ctl, name)
        self.pid = pid
        self.pid_start = process_start_time(pid)
        self.scratch = scratch
        self.cgroup_dirs = cgroup_dirs
        self._oom_kills = 0  # the cgroup's OOM kill count after the last exec (a new cgroup has none)
        self._env = {**BASE_ENV, **rootfs.env, "HOSTNAME": name, **spec_env}
        self._spec_env_keys = set(spec_env)
        self.workdir = rootfs.workdir or "/"
        # The image config's User ("name", "uid", "name:group"): the user of every call that names
        # none. The group part is not honoured separately: the user's own groups apply.
        self.default_user = rootfs.user.split(":", 1)[0] or None
        self._destroyed = False
        self.nat: subprocess.Popen[bytes] | None = None  # pasta's watcher, for network=True

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
        out = run(self._channel, message, name=self.name, stdin=stdin, output_limit=output_limit,
                  timeout=timeout, on_output=on_output, cancel=cancel)
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
                 timeout: float = FILE_OP_TIMEOUT, stdout_fd: int | None = None) -> None:
        user = user if user is not None else self.default_user
        if user is not None:
            message["user"] = str(user)
        result = run(self._channel, message, name=self.name, stdin=stdin, output_limit=1 << 16,
                     timeout=timeout, stdout_sink=stdout_sink, cancel=cancel, stdout_fd=stdout_fd)
        if result.error is not None:
            raise_error(result.error, self.name, f"{message['op']} {message['path']}")
        if result.timed_out:  # a bound on every host-side read: a stalled or stalling guest side
            raise GuestError(f"{message['op']} {message['path']} in {self.name}: took longer than {timeout:.0f}s")
        if result.exit_code != 0 and not result.cancelled:
            detail = result.stderr.decode(errors="replace").strip().splitlines()
            raise GuestError(f"{message['op']} {message['path']} in {self.name}: "
                             f"{detail[-1] if detail else f'exit {result.exit_code}'}")

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
        """Run the guest side's extract with ``produce`` writing its stdin from a thread.

        A socket, not a pipe, for the same reason as in :meth:`_stream_out`: the guest's tar is
        the guest's to replace, and a process it leaves behind holding stdin unread would keep
        ``produce`` blocked forever; once the guest side has exited, shutting down our end
        wakes ``produce`` with a broken pipe.
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
        try:
            with theirs, os.fdopen(theirs.fileno(), "rb", closefd=False) as source:
                self._file_op({"op": "put_archive", "path": guest_dir}, user=user, stdin=source)
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
        return ""  # a namespace guest has no console; its history is the exec transcript

    def keep(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours:
            try:
                self._channel.send({"op": "keep"}, [theirs.fileno()])
            finally:
                theirs.close()
            ours.settimeout(DESTROY_TIMEOUT)
            if not ours.recv(4096):
                raise GuestError(f"guest {self.name} is gone (its init exited)")

    def registry_data(self) -> dict[str, Any]:
        return {"pid": self.pid, "pid_start": self.pid_start, "scratch": str(self.scratch),
                "cgroups": self.cgroup_dirs}

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._channel.close()
        destroy_recorded(self.registry_data())  # may raise; a retry starts over
        if self.nat is not None:
            _nsnet.stop_nat(self.nat)  # exiting by itself already: the guest's init is gone
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
        if not wait_gone(pid, DESTROY_TIMEOUT):
            raise GuestError(f"guest init {pid} did not exit within {DESTROY_TIMEOUT:.0f}s of SIGKILL")
    elif not pid:
        # Recorded before create returned (see reserve): whatever runs in the
        # guest's own cgroup is that guest's, half made.
        for path in data.get("cgroups") or []:
            cgroups.kill_members(path)
    for path in data.get("cgroups") or []:
        cgroups.remove(path)
    scratch = data.get("scratch")
    if scratch:
        try:
            os.rmdir(scratch)  # only an empty mount point: the guest's files lived in its tmpfs
        except FileNotFoundError:
            pass


class NamespaceBackend:
    name: ClassVar[str] = "namespace"
    isolation: ClassVar[str] = "namespace"
    idle_guests_are_free: ClassVar[bool] = True  # an idle init: ~2.5 MB, no CPU

    def __init__(self, options: BackendOptions | None = None) -> None:
        self.options = options or BackendOptions()
        self._zygote: Zygote | None = None
        self._zygote_lock = threading.Lock()
        self._rootfs: dict[str, Rootfs] = {}
        self.userns = os.geteuid() != 0
        self.limits = cgroups.detect()

    @classmethod
    def probe(cls) -> ProbeResult:
        if not sys.platform.startswith("linux"):
            return ProbeResult(False, "the namespace backend needs Linux")
        if os.geteuid() != 0 and not _userns_allowed():
            return ProbeResult(False, "not root and unprivileged user namespaces are disabled "
                                      "(sysctl user.max_user_namespaces / kernel.unprivileged_userns_clone)")
        return ProbeResult(True, "Linux namespaces and overlayfs are available")

    @classmethod
    def describe_host(cls) -> list[str]:
        """Header lines: what this host lets a namespace guest have."""
        mode = "as root (capabilities bounded)" if os.geteuid() == 0 else "in a user namespace (unprivileged)"
        return [f"limits: {cgroups.detect().summary}", f"guests run {mode}"]

    @classmethod
    def check_baseline(cls, baseline: Baseline, *, option: str = "--smol-baseline") -> None:
        if baseline.kind == "smolmachine":
            raise UsageError(f"{option}={baseline.reference}: a .smolmachine needs the smol backend; the "
                             "namespace backend takes a rootfs dir, a rootfs tarball (.tar, .tar.gz, "
                             ".tar.zst), a docker-save/OCI archive or a registry image")
        if baseline.kind == "registry" and baseline.path is None:
            raise UsageError(f"{option}={baseline.reference}: a registry image must be pinned and pulled "
                             "first (pytest_smolvm.baselines.oci.pull.resolve_image)")

    def prepare_run(self, baseline: Baseline) -> dict[str, str]:
        self.rootfs(baseline)  # unpacked once per host, here rather than inside the first test
        return {}  # workers find the unpacked baseline by digest in the host-wide cache

    def share_source(self, spec: VMSpec) -> str:
        raise ProvisionError("the namespace backend has no shared machines: every guest is made where it is used")

    def rootfs(self, baseline: Baseline) -> Rootfs:
        if baseline.digest not in self._rootfs:
            self._rootfs[baseline.digest] = unpack(baseline, by=self.options.labels.get("worker", "main"))
        return self._rootfs[baseline.digest]

    def _helper(self) -> Zygote:
        with self._zygote_lock:
            if self._zygote is not None and self._zygote.dead:
                self._zygote.close()  # a retry gets a fresh helper; live guests do not need the old one
                self._zygote = None
            if self._zygote is None:
                self._zygote = Zygote(self._state[1])
            return self._zygote

    @functools.cached_property
    def _state(self) -> tuple[Path, str]:
        """The dir of this backend's records and scratch dirs (the runtime dir: nothing of a
        namespace guest survives a reboot) and its tag, read once per backend: its zygote
        carries the tag, and every create and record would otherwise read the environment again."""
        state = runtime_dir()
        return state, cgroups.state_tag(state)

    def create(self, spec: VMSpec) -> NamespaceGuest:
        allowed = _nsnet.allowed_networks(spec.allow_hosts) if spec.allow_hosts else None
        if spec.network or allowed is not None:
            if self.userns:
                # The host cannot open a user-namespace guest's netns yet (its init is not
                # dumpable; the zygote would have to pass the fd): refused, never the host's network.
                raise ProvisionError("network=True on the namespace backend needs root for now "
                                     "(user-namespace mode has no NAT yet): run as root or use the smol backend")
            _nsnet.pasta()  # the install hint, before anything is made
        rootfs = self.rootfs(spec.baseline)
        state, tag = self._state
        scratch = state / "scratch" / spec.name
        scratch.mkdir(parents=True, exist_ok=False)
        relax = set(spec.relax)
        bpf = "" if "seccomp" in relax else seccomp.guest_filter().hex()  # raises the install hint
        cgroup_dirs: list[str] = []
        try:
            cgroup_dirs = cgroups.create(self.limits, f"{tag}-{spec.name}",
                                         cpus=spec.cpus, memory_mb=spec.memory_mb, defaults="limits" not in relax,
                                         disk_mb=spec.disk_mb)
            reply, fds = self._helper().request({
                "op": "create", "name": spec.name, "hostname": spec.name[:64], "scratch": str(scratch),
                "state": str(state), "lower": [str(rootfs.path)], "disk_mb": spec.disk_mb,
                "network": spec.network, "userns": self.userns, "seccomp": bpf,
                "rlimits": self._rlimits(spec, relax),
                "cgroup_procs": [os.path.join(d, "cgroup.procs") for d in cgroup_dirs]})
            if "error" in reply:
                raise ProvisionError(f"namespace guest {spec.name}: {reply['error']}")
        except BaseException:
            for path in cgroup_dirs:
                cgroups.remove(path)
            scratch.rmdir()
            raise
        ctl = socket.socket(fileno=fds[0])
        guest = NamespaceGuest(spec.name, ctl, int(reply["pid"]), scratch, cgroup_dirs, rootfs, spec.env)
        if spec.network or allowed is not None:
            try:
                guest.nat = _nsnet.start_nat(guest.pid, scratch, allowed[0] if allowed is not None else None)
                if allowed is not None and allowed[1]:
                    hosts = "".join(f"{a} {name}\n" for name, addrs in allowed[1].items() for a in addrs)
                    guest.exec(["sh", "-c", "cat >> /etc/hosts"], env={}, workdir=None, stdin=hosts.encode(),
                               timeout=30, output_limit=1 << 16, user="root")
            except BaseException:
                guest.destroy()
                raise
        return guest

    def reserve(self, name: str) -> dict[str, Any]:
        """What ``create`` makes on the host for ``name``, saved in its record before it exists.

        The helper hears of it first, so that if this process dies before ``create`` returns
        (a guest made ahead is often half made when a test kills its pytest), the helper
        removes what was made and the record, as it does for the guests it made. If both die,
        the record still gives the reaper everything it needs; no pid yet: nothing to kill.
        """
        state, tag = self._state
        data = {"scratch": str(state / "scratch" / name), "cgroups": cgroups.planned(self.limits, f"{tag}-{name}")}
        self._helper().tell({"op": "expect", "name": name, "state": str(state), **data})
        return data

    def _rlimits(self, spec: VMSpec, relax: set[str]) -> dict[str, int]:
        """Per-guest rlimits where no cgroup controller does the job (user-namespace mode)."""
        if "limits" in relax:
            return {}
        found: dict[str, int] = {}
        if "pids" not in self.limits.parents:
            found["RLIMIT_NPROC"] = cgroups.DEFAULT_PIDS_MAX
        if "memory" not in self.limits.parents:
            found["RLIMIT_FSIZE"] = spec.disk_mb << 20
        return found

    def derive_baseline(self, baseline: Baseline, key: str, populate: Callable[[Guest], None],
                        scratch_guest: Callable[[Baseline], AbstractContextManager[Guest]]) -> Baseline:
        """Run ``populate`` in a guest, once per host per ``key``, and keep its root as a rootfs."""
        rootfs = self.rootfs(baseline)

        def capture(staging: Path) -> None:
            with scratch_guest(baseline) as guest:
                populate(guest)
                assert isinstance(guest, NamespaceGuest)
                guest.export_root(lambda stream: apply_layer(stream, staging, squash_owner=False,
                                                             what="warm baseline export", guest_export=True))

        warm = prepare_derived(key, baseline, rootfs, capture, by=self.options.labels.get("worker", "main"))
        derived = Baseline(f"{baseline.reference} + setup", "rootfs-dir", warm.path, f"sha256:{key}")
        self._rootfs[derived.digest] = warm
        return derived

    def destroy_recorded(self, data: Mapping[str, Any]) -> None:
        destroy_recorded(data)

    @classmethod
    def reap_unrecorded(cls) -> list[str]:
        return []  # every namespace guest is in the registry; baselines are a cache, not guests

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None


def _userns_allowed() -> bool:
    try:
        if Path("/proc/sys/kernel/unprivileged_userns_clone").read_text().strip() == "0":
            return False
        return int(Path("/proc/sys/user/max_user_namespaces").read_text()) > 0
    except (OSError, ValueError):
        return True
