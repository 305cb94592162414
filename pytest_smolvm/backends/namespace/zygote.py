"""The per-process helper that forks namespace guests: started once, fed the helper's code.

See ``helper/`` for the code it runs; this is the host side: starting it with an argv and an
environment that name no host path, and one request/reply at a time over its socket.
"""

from __future__ import annotations

import functools
import importlib.machinery
import json
import marshal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_smolvm.errors import ProvisionError

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
MAX_MESSAGE = 1 << 20


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
