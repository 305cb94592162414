"""The xdist controller's side of the hand-over: a loopback socket its workers ask for the plan.

It starts when the controller configures its first worker, so it must cost nothing: standard
library only, a listening socket and one daemon thread. What a request means (plan.py, with
backends and baselines behind it) is imported by ``answer`` only when a worker first asks.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

MAX_REQUEST = 1 << 20

Answer = Callable[[dict[str, Any]], dict[str, Any]]


class PlanService:
    """Serves ``answer`` to the run's workers on 127.0.0.1; every request carries the run's secret."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self.secret = secrets.token_hex(16)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        threading.Thread(target=self._serve, name="smolvm-plan-service", daemon=True).start()

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}:{self.secret}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), name="smolvm-plan-request", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as requests:
            try:
                request = json.loads(requests.readline(MAX_REQUEST))
            except ValueError:
                request = {}
            if not isinstance(request, dict) or not hmac.compare_digest(str(request.get("secret", "")),
                                                                        self.secret):
                reply: dict[str, Any] = {"error": "wrong secret", "kind": "provision"}
            else:
                reply = self._answer(request)
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass  # the worker went away; nothing to tell it

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() in the serving thread
        except OSError:
            pass
        self._sock.close()
