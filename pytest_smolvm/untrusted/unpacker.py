"""The confined unpacker's long-lived process: imports once, forks one confined child per stream.

Starting a fresh interpreter per unpack cost an interpreter's start and this package's imports
on every ``copy_out`` (docs/performance.md); a fork of a process that has both already costs a
fork. This process is started by :mod:`.confined` with ``-I -S``, single-threaded (so each
child may enter a user namespace), and lives as long as its parent's socket: when the parent
exits or dies, ``recv`` returns nothing and so does this process.

One request: a JSON config and three fds (the destination's dir fd, the stream, the result
pipe). The child puts the stream on fd 0 and the result pipe on fd 1, confines itself
(:func:`.confined.confine`) and runs the in-process walker; it writes ``{"pid"}`` first, then
``{"ok"}`` or ``{"error"}``. A child killed by its caps writes no last line; the parent says so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import Any

from pytest_smolvm.errors import GuestError
from pytest_smolvm.untrusted import confined, hostfs, rules

MAX_REQUEST = 1 << 16


def serve(sock: socket.socket, seccomp: Any) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_REQUEST, 3)
        except InterruptedError:
            continue
        if not data:
            os._exit(0)  # the parent is gone
        try:
            if len(fds) != 3:
                continue
            root_fd, stream_fd, result_fd = fds
            if os.fork() == 0:
                sock.close()
                _child(json.loads(data), root_fd, stream_fd, result_fd, seccomp)  # never returns
        finally:
            for fd in fds:
                os.close(fd)


def _child(config: dict[str, Any], root_fd: int, stream_fd: int, result_fd: int, seccomp: Any) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.dup2(stream_fd, 0)
    os.dup2(result_fd, 1)
    os.write(1, (json.dumps({"pid": os.getpid()}) + "\n").encode())
    policy = rules.Policy(**config["policy"])
    caps = rules.Caps(**config["caps"])
    try:
        confined.confine(root_fd, policy, caps, seccomp)
        hostfs.extract(os.fdopen(0, "rb", buffering=0), "/", policy, caps)
    except (GuestError, OSError) as exc:
        message = str(exc) if isinstance(exc, GuestError) else f"{policy.what}: cannot unpack: {exc}"
        os.write(1, (json.dumps({"error": message}) + "\n").encode())
        os._exit(1)
    except BaseException as exc:  # a MemoryError past the cap, a bug: said, never a hang
        os.write(1, (json.dumps({"error": f"{policy.what}: the unpacking helper failed: "
                                          f"{type(exc).__name__}: {exc}"[:500]}) + "\n").encode())
        os._exit(1)
    os.write(1, b'{"ok": true}\n')
    os._exit(0)


def main() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, ())  # not the mask of the host thread that started us
    try:
        import pyseccomp
    except (ImportError, OSError):
        pyseccomp = None  # every other wall holds without the filter
    serve(socket.socket(fileno=int(sys.argv[2])), pyseccomp)
