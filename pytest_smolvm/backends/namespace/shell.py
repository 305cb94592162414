"""``pytest-smolvm shell`` into a kept namespace guest: one more command the guest's init runs.

A kept guest is the one a hostile guest has been waiting for: the user runs a shell in it by
hand. So the shell is not a host process that enters the guest (``nsenter`` with every
capability was; joining the namespaces by ``setns`` needed root and could not work in
user-namespace mode). When a guest is kept, the host binds a *door*, a listening socket in
the guest's scratch dir (inside the private runtime dir: only this user reaches it), and hands
it to the guest's init. The shell connects and sends one exec request, with stdio the host made
(a pty, or pipes: never the user's own terminal, see relay.py) as the command's
stdin/stdout/stderr; the init starts it as it starts every guest command:
in the guest's namespaces, cgroup, root, capability set and seccomp filter, plus
``no_new_privs``. The recorded init's pid must still carry its recorded start time (a reused
pid is some other process), and the door must be a socket, reached through the scratch dir's
own fd without following a link.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_smolvm.backends.namespace.relay import Stdio, ended_by_signals, user_terminal, wants_pty
from pytest_smolvm.host.procs import process_start_time

SHELL_DOOR = "shell.sock"
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_STATUS = 1 << 16


@contextlib.contextmanager
def _at(directory: Path | str) -> Iterator[str]:
    """``directory/shell.sock`` as a short path through the directory's own fd: a socket path
    is limited to 108 bytes, and the directory is reached without following a link."""
    fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{SHELL_DOOR}"
    finally:
        os.close(fd)


@contextlib.contextmanager
def bind_door(scratch: Path) -> Iterator[socket.socket]:
    """A listening door in ``scratch`` for the guest's init to serve (closed here once sent)."""
    door = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with _at(scratch) as path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            door.bind(path)
            os.chmod(path, 0o600)
        door.listen(4)
        yield door
    finally:
        door.close()


def remove_door(scratch: Path | str) -> None:
    """Take a kept guest's door away (its destroy), through the scratch dir's own fd."""
    try:
        fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHELL_DOOR, dir_fd=fd)
    finally:
        os.close(fd)


def shell(data: Mapping[str, Any], name: str, command: Sequence[str]) -> int:
    """Run ``command`` (default ``/bin/sh``) in the kept guest ``data`` describes; its exit status."""
    pid = int(data.get("pid") or 0)
    if pid <= 1 or process_start_time(pid) != data.get("pid_start"):
        print(f"pytest-smolvm shell: guest {name} is gone (its init is not running)", file=sys.stderr)
        return 2
    if data.get("shell_door") != SHELL_DOOR or not data.get("scratch"):
        print(f"pytest-smolvm shell: guest {name} was not kept by this version of pytest-smolvm; "
              "keep it again (--smol-keep) to shell in", file=sys.stderr)
        return 2
    try:
        door = _connect(Path(str(data["scratch"])))
    except OSError as exc:
        print(f"pytest-smolvm shell: cannot reach guest {name}'s init: {exc.strerror or exc}", file=sys.stderr)
        return 2
    env = {"PATH": GUEST_PATH, "HOME": "/root", "HOSTNAME": name, "TERM": os.environ.get("TERM", "xterm")}
    request = {"op": "exec", "argv": list(command) or ["/bin/sh"], "env": env, "cwd": "/", "no_new_privs": True}
    with door:
        return _run(door, request, name)


def _connect(scratch: Path) -> socket.socket:
    door = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with _at(scratch) as path:
            if not stat.S_ISSOCK(os.stat(path, follow_symlinks=False).st_mode):
                raise OSError(f"{scratch / SHELL_DOOR} is not a socket")
            door.connect(path)
    except BaseException:
        door.close()
        raise
    return door


def _run(door: socket.socket, request: dict[str, Any], name: str) -> int:
    """Send the exec with stdio the host made (relay.py), relay them, and return the exit status.

    Whatever way this ends (exit, error, Ctrl-C, SIGTERM), the command's group is killed and the
    host's ends of its stdio are closed before the user's shell gets its terminal back.
    """
    stdio = Stdio(pty=wants_pty())
    request = {**request, "tty": stdio.pty}
    started: int | None = None
    status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def on_reply(data: bytes) -> int | None:
        nonlocal started
        if not data:
            print(f"pytest-smolvm shell: guest {name}'s init went away", file=sys.stderr)
            return 2
        reply = json.loads(data)
        if "pid" in reply:
            started = int(reply["pid"])
        elif "exit" in reply:
            return int(reply["exit"])
        elif "error" in reply:
            error = reply["error"]
            print(f"pytest-smolvm shell: {error.get('strerror') or error.get('message') or error}", file=sys.stderr)
            return 127
        return None

    # The user's terminal is restored last: what the command queued is drained through it raw.
    with status, ended_by_signals(), user_terminal(stdio):
        try:
            try:
                socket.send_fds(door, [json.dumps(request).encode()], [*stdio.theirs, theirs.fileno()])
            finally:
                theirs.close()
                stdio.sent()
            # Ctrl-C (a pipe's stdin; a pty's is a key for the guest) reaches this process, never
            # the guest's command (a session of its own in the guest): pass it on as a kill.
            previous = signal.signal(signal.SIGINT, lambda *_: _kill(door, started))
            try:
                return stdio.relay(status.fileno(), on_reply)
            finally:
                signal.signal(signal.SIGINT, previous)
        finally:
            _kill(door, started)  # what it left in its group: a terminal's hangup, made certain
            stdio.drain()
            stdio.close()


def _kill(door: socket.socket, pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(OSError):
            door.send(json.dumps({"op": "kill", "pid": pid}).encode())
