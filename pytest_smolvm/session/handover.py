"""The xdist controller's side of the hand-over: a loopback socket its workers ask for the plan.

It starts when the controller configures its first worker, so it must cost nothing: standard
library only, a listening socket and one daemon thread. What a request means (plan.py, with
backends and baselines behind it) is imported by ``answer`` only when a worker first asks.

Any local process can connect to 127.0.0.1, so nobody's connection may cost the controller
more than a bounded share: at most ``plan_service_connections`` are served at once (the rest
wait in the listen backlog), and a request must arrive whole within ``plan_service_read``
seconds of the connection, or it is dropped unanswered.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from pytest_smolvm import limits
from pytest_smolvm.host.signals import start_thread

MAX_REQUEST = 1 << 20

Answer = Callable[[dict[str, Any]], dict[str, Any]]


class PlanService:
    """Serves ``answer`` to the run's workers on 127.0.0.1; every request carries the run's secret."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self.secret = secrets.token_hex(16)
        self._slots = threading.BoundedSemaphore(limits.LIMITS.plan_service_connections)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        start_thread(self._serve, name="smolvm-plan-service")

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}:{self.secret}"

    def _serve(self) -> None:
        while True:
            self._slots.acquire()  # a free handler first: past the cap, connections wait in the backlog
            try:
                conn, _ = self._sock.accept()
            except OSError:
                self._slots.release()
                return  # closed
            start_thread(self._handle, name="smolvm-plan-request", args=(conn,))

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                line = _read_line(conn, time.monotonic() + limits.LIMITS.plan_service_read)
                if line is None:
                    return  # silent, slow or oversized: no answer, the slot is free again
                try:
                    request = json.loads(line)
                except ValueError:
                    request = {}
                if not isinstance(request, dict) or not hmac.compare_digest(str(request.get("secret", "")),
                                                                            self.secret):
                    reply: dict[str, Any] = {"error": "wrong secret", "kind": "provision"}
                else:
                    reply = self._answer(request)
                conn.settimeout(limits.LIMITS.plan_service_read)  # a worker that never reads its reply
                try:
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass  # the worker went away; nothing to tell it
        finally:
            self._slots.release()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() in the serving thread
        except OSError:
            pass
        self._sock.close()


def _read_line(conn: socket.socket, deadline: float) -> bytes | None:
    """One request line, whole by ``deadline`` and at most MAX_REQUEST bytes; else None."""
    received = bytearray()
    while b"\n" not in received:
        left = deadline - time.monotonic()
        if left <= 0 or len(received) > MAX_REQUEST:
            return None
        conn.settimeout(left)
        try:
            data = conn.recv(65536)
        except OSError:  # the deadline passed (socket.timeout is an OSError), or the peer reset
            return None
        if not data:
            return None
        received += data
    return bytes(received[:received.index(b"\n")])
