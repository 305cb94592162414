"""The guest's pid 1: serves exec and file requests, reaps orphans, exits with its owner.

Part of the namespace backend's helper (see ``__init__``): standard library only.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import termios  # imported with the zygote: the guest's root has no host extension modules
import time
from typing import Any

from pytest_smolvm.backends.namespace.helper.kernel import (
    KILL_PASSES,
    PR_SET_NO_NEW_PRIVS,
    SIGNAL_EXIT_BASE,
    _check,
    _prctl,
    _recv,
    _write_small,
)
from pytest_smolvm.backends.namespace.helper.requests import (
    FILE_OPS,
    STATUS_FD,
    Refused,
    UserError,
    _become,
    _error,
    _exec,
    _read_body,
    _report,
    _spawn_vpe,
)
from pytest_smolvm.backends.namespace.helper.stage import UPPER_FD

# A killed group's last members are looked for this often, and waited for at most this long.
DRAIN_POLL_MS = 5
GROUP_GONE_WAIT = 2.0

# The guest's pid 1 is not the host's init, so the kernel's OOM killer may choose it, and a
# Python init is often its cgroup's biggest process: one command over memory_mb took the whole
# guest with it. A VM's kernel never kills its init, so every process the init starts gets the
# highest score (which only raises, needing no privilege) and the command that grew dies instead.
# On the host as a whole it ranks guest processes first too.
OOM_SCORE_KILL_FIRST = b"1000"
OWN_OOM_SCORE = "/proc/self/oom_score_adj"


class Init:
    """pid 1 of one guest: serves requests from the host and reaps every orphan.

    Every request that starts a guest process brings its own fds: stdin, stdout, stderr and a
    *status* socket. The init reports on that socket only ({"pid"}, then {"exit"}, or an
    {"error"}), so requests never share a reply channel and the host can run any number of
    them at once. A request too big for one control message comes as a memfd (``body``).
    """

    def __init__(self, ctl: socket.socket, upper_fd: int | None = None) -> None:
        self.ctl = ctl
        # The guest's upper layer, opened before the pivot (after it nothing names it): each
        # put_archive's child gets it as UPPER_FD, to stage a new tree in (stage.py
        # ``open_stage``). Kept above the fds a child's dup2s fill, which would close it.
        self.upper_fd: int | None = None
        if upper_fd is not None:
            self.upper_fd = fcntl.fcntl(upper_fd, fcntl.F_DUPFD_CLOEXEC, UPPER_FD + 1)
            os.close(upper_fd)
        self.children: dict[int, int] = {}  # pid -> that request's status fd
        # A command whose group was killed (a timeout, a cancel) is reported ended only once its
        # whole group is gone: a killed process can take a while to die (one that freed 512 MiB
        # was still running after its shell had been reaped), and the next command must not see it.
        self.killed: set[int] = set()  # leaders of killed groups, not yet reaped
        self.draining: dict[int, tuple[int, int, float]] = {}  # leader -> (status fd, exit code, deadline)
        self.keep = False
        with open(OWN_OOM_SCORE, "rb") as own:
            self.oom_score = own.read().strip()  # the init's own, which each spawn puts back
        try:  # the same score again: whether the init may set its own (not in a user namespace)
            _write_small(OWN_OOM_SCORE, self.oom_score)
            self.ranks_in_spawn = True
        except OSError:
            self.ranks_in_spawn = False
        self.poller = select.poll()
        # A kept guest's shell door: a listening socket the host bound in its private scratch
        # dir and handed over with "keep"; each connection is one more control channel.
        self.door: socket.socket | None = None
        self.shells: dict[int, socket.socket] = {}
        rfd, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_r = rfd
        signal.set_wakeup_fd(self.wake_w)
        # SIGPIPE and SIGINT are caught by a no-op rather than ignored (Python and the zygote
        # ignore them) only so that execve gives spawned commands their default dispositions,
        # as the forked child that used to start them reset them. For this process it is the
        # same: nothing happens, and a write to a closed socket still fails with EPIPE.
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE, signal.SIGINT):
            signal.signal(sig, lambda *_: None)

    def serve(self) -> None:
        poller = self.poller
        poller.register(self.ctl, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while True:
            for fd, events in poller.poll(DRAIN_POLL_MS if self.draining else None):
                if self.door is not None and fd == self.door.fileno():
                    self.open_shell_channel()
                elif fd in self.shells:
                    self.serve_shell_channel(fd, events)
                elif fd == self.wake_r:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                    self.reap()
                elif events & (select.POLLHUP | select.POLLERR) and not events & select.POLLIN:
                    self.owner_gone()
                    poller.unregister(self.ctl)
                else:
                    try:
                        message, fds = _recv(self.ctl)
                    except OSError:
                        message, fds = None, []
                    if message is None:
                        self.owner_gone()
                        poller.unregister(self.ctl)
                    else:
                        self.handle_safely(message, fds)
            self.reap()
            if self.draining:
                self.report_drained()

    def open_shell_channel(self) -> None:
        assert self.door is not None
        try:
            conn, _ = self.door.accept()
        except OSError:
            return
        conn.setblocking(True)
        self.shells[conn.fileno()] = conn
        self.poller.register(conn, select.POLLIN)

    def serve_shell_channel(self, fd: int, events: int) -> None:
        conn = self.shells[fd]
        message: dict[str, Any] | None = None
        fds: list[int] = []
        if events & select.POLLIN:
            try:
                message, fds = _recv(conn)
            except OSError:
                message = None
        if message is None:  # the shell's end closed
            self.poller.unregister(fd)
            del self.shells[fd]
            conn.close()
            return
        if message.get("op") not in ("exec", "kill"):  # a shell runs commands; it never keeps or reopens doors
            for extra in fds:
                os.close(extra)
            return
        self.handle_safely(message, fds)

    def owner_gone(self) -> None:
        if not self.keep:
            os._exit(0)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            status_fd = self.children.pop(pid, None)
            if status_fd is not None:
                code = os.waitstatus_to_exitcode(status)
                if code < 0:
                    code = SIGNAL_EXIT_BASE - code
                if pid in self.killed:
                    self.killed.discard(pid)
                    self.draining[pid] = (status_fd, code, time.monotonic() + GROUP_GONE_WAIT)
                else:
                    _report(status_fd, {"exit": code})
                    os.close(status_fd)

    def report_drained(self) -> None:
        """Report each killed command whose group is gone (or that has waited long enough: a
        process stuck in the kernel cannot hold its request for ever)."""
        now = time.monotonic()
        for leader, (status_fd, code, deadline) in list(self.draining.items()):
            try:
                os.killpg(leader, 0)
                if now < deadline:
                    continue
            except ProcessLookupError:
                pass
            del self.draining[leader]
            _report(status_fd, {"exit": code})
            os.close(status_fd)

    def handle_safely(self, message: dict[str, Any], fds: list[int]) -> None:
        """pid 1 must outlive any one malformed request: its death would end the guest."""
        try:
            if message.get("body"):
                body_fd = fds.pop()
                try:
                    message = json.loads(_read_body(body_fd))
                finally:
                    os.close(body_fd)
            self.handle(message, fds)
        except Exception as exc:
            if len(fds) > 3:
                error = (_error(exc, None, str(message.get("op"))) if isinstance(exc, OSError)  # fork: EAGAIN
                         else {"message": f"bad request: {type(exc).__name__}: {exc}"})
                _report(fds[3], {"error": error})
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        if op == "kill":
            pid = message["pid"]
            if pid <= 1:  # 0 stands for "never started"; killpg(0) would hit our own group
                return
            if pid in self.children:
                # The child itself too: a guest process may have stopped it before its setsid,
                # and then there is no group of that id (SIGKILL ends a stopped process). Only
                # our own unreaped child: its pid cannot have been reused.
                os.kill(pid, signal.SIGKILL)
                self.killed.add(pid)
            # Repeat: a forking group (a fork bomb) can outrun a single pass of killpg.
            for _ in range(KILL_PASSES):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    break
            return
        if op == "keep":
            self.keep = bool(message.get("keep", True))
            if len(fds) > 1 and self.door is None:
                self.door = socket.socket(fileno=fds[1])
                self.door.setblocking(False)
                self.poller.register(self.door, select.POLLIN)
            _report(fds[0], {"ok": True})
            os.close(fds[0])
            return
        if len(fds) != 4:
            raise ValueError(f"{op} needs 4 fds (stdin, stdout, stderr, status), got {len(fds)}")
        if op == "exec" and message.get("user") is None and not message.get("no_new_privs"):
            self.spawn(message, fds)
            return
        # A file operation, or an exec as another user: the child runs this file's Python
        # code (user lookup, setuid, the operation) before anything else.
        pid = os.fork()
        if pid == 0:
            self.run_child(message, fds)  # never returns
        for fd in fds[:3]:
            os.close(fd)
        self.children[pid] = fds[3]
        _report(fds[3], {"pid": pid})

    def spawn(self, message: dict[str, Any], fds: list[int]) -> None:
        """Start an exec request's command through posix_spawn (vfork + execve), not os.fork.

        Why: os.fork() of this Python process copies its page tables, and then each side pays
        a copy-on-write fault for every page it touches until the child's execve; on
        paravirtualized hosts that is most of an exec's cost (docs/performance.md). posix_spawn uses vfork: no
        copy, and no Python runs between the two (subprocess.Popen's Python, in a freshly
        forked init, costs copy-on-write faults of its own). The command starts in a new
        session (its pid is its process group, for timeouts), with default dispositions for
        the signals this process catches or ignores, fds 0/1/2 from the request and no other
        fd (every fd of this process is close-on-exec), the cwd, and execvpe's PATH search
        over the request's env. A failed chdir or execve is reported on the status socket
        with its errno.

        vfork holds this process until the child execs: a guest process can stop the child in
        between (``kill -STOP -1`` reaches every process but pid 1). Then only the host can
        end it, and does when a request's timeout or cancel fires (``channel.Channel.free_held``).
        """
        argv, env = message["argv"], message["env"]
        cwd = message.get("cwd") or "/"
        status_fd = fds[3]
        try:
            # The chdir happens here, not through Popen(cwd=): then every OSError Popen
            # raises is execve's, and a bad workdir is reported as the workdir's error.
            try:
                os.chdir(cwd)
            except OSError as exc:
                self.spawn_failed(fds, _error(exc, cwd, "workdir"))
                return
            try:
                pid = self.spawn_ranked(argv, env, fds[:3])
            except OSError as exc:
                self.spawn_failed(fds, _error(exc, argv[0], "exec"))
                return
        finally:
            os.chdir("/")
        for fd in fds[:3]:
            os.close(fd)
        self.children[pid] = status_fd
        _report(status_fd, {"pid": pid})

    def spawn_ranked(self, argv: list[str], env: dict[str, str], fds: list[int]) -> int:
        """Spawn a command that is ranked first for the OOM killer from its first instruction:
        it inherits the score the init takes for the spawn (the init is blocked in it meanwhile),
        which the init then puts back to its own (down to where it was: no privilege needed).
        A score written after the spawn came too late for what the command forked at once (seen
        in ~4% of commands), and those processes kept the init's score for good. An init that
        may not set its own score (user-namespace mode) still writes the command's after."""
        if not self.ranks_in_spawn:
            pid = _spawn_vpe(argv, env, fds)
            _kill_first_on_oom(pid)
            return pid
        _write_small(OWN_OOM_SCORE, OOM_SCORE_KILL_FIRST)
        try:
            return _spawn_vpe(argv, env, fds)
        finally:
            _write_small(OWN_OOM_SCORE, self.oom_score)

    def spawn_failed(self, fds: list[int], error: dict[str, Any]) -> None:
        _report(fds[3], {"error": error})  # no process: no pid, no exit
        for fd in fds:
            os.close(fd)

    def run_child(self, message: dict[str, Any], fds: list[int]) -> None:
        code = 1
        try:
            _kill_first_on_oom("self")
            os.setsid()
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
            if message.get("tty"):  # the pty the shell door's host made: this session's terminal
                _take_terminal()
            os.dup2(fds[3], STATUS_FD, inheritable=False)  # closed by a successful execve
            kept = STATUS_FD
            if message["op"] == "put_archive" and self.upper_fd is not None:
                kept = os.dup2(self.upper_fd, UPPER_FD, inheritable=False)
            os.closerange(kept + 1, 65536)
            if message.get("user") is not None:
                _become(message)
            if message.get("no_new_privs"):  # a shell a user opened: setuid programs gain nothing
                _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "prctl(PR_SET_NO_NEW_PRIVS)")
            if message["op"] == "exec":
                _exec(message)
            code = FILE_OPS[message["op"]](message)
        except SystemExit as exc:
            code = int(exc.code or 0)
        except UserError as exc:
            _report(STATUS_FD, {"error": {"user": str(exc)}})
        except Refused as exc:
            _report(STATUS_FD, {"error": {"message": str(exc)}})
        except OSError as exc:
            _report(STATUS_FD, {"error": _error(exc, message.get("path"), message["op"])})
        except BaseException as exc:  # report anything to the host, never crash pid 1's loop
            try:
                os.write(2, f"{type(exc).__name__}: {exc}\n".encode(errors="replace"))
            except OSError:
                pass
        os._exit(code)


def _kill_first_on_oom(pid: int | str) -> None:
    """Rank a process the init started above the init for the OOM killer (OOM_SCORE_KILL_FIRST).

    Best effort: a command that has already ended, or changed its uid, keeps its score, which
    puts only its own guest at risk; a failure here must not take the init down.
    """
    try:
        _write_small(f"/proc/{pid}/oom_score_adj", OOM_SCORE_KILL_FIRST)
    except OSError:
        pass


def _take_terminal() -> None:
    """Make fd 0 (the host-made pty's slave) this new session's controlling terminal, so that
    keys the user types (Ctrl-C, Ctrl-Z) signal the command's foreground job. Best effort: a
    shell without job control still works."""
    try:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    except OSError:
        pass
