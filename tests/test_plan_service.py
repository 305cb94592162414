"""The xdist controller's plan service against local clients that misbehave: any process on
the host can connect to its loopback port, so none may hold a thread or a slot for long."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_smolvm import limits
from pytest_smolvm.session.handover import PlanService


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> Iterator[PlanService]:
    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, plan_service_read=1.0,
                                                              plan_service_connections=4))
    served = PlanService(lambda request: {"answer": request.get("op")})
    yield served
    served.close()


def _connect(service: PlanService) -> socket.socket:
    host, port, _secret = service.address.split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _ask(service: PlanService) -> dict[str, Any]:
    with _connect(service) as sock:
        sock.sendall(json.dumps({"op": "plan", "secret": service.secret}).encode() + b"\n")
        reply: dict[str, Any] = json.loads(sock.makefile("rb").readline())
        return reply


def _handlers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "smolvm-plan-request")


def test_clients_that_never_write_hold_neither_threads_nor_the_service(service: PlanService) -> None:
    idle = [_connect(service) for _ in range(40)]
    try:
        time.sleep(0.3)
        assert _handlers() <= 4  # the rest wait in the listen backlog, costing no thread
        began = time.monotonic()
        assert _ask(service) == {"answer": "plan"}  # served once the silent ones time out
        assert time.monotonic() - began < 30
        for sock in idle[:4]:  # the first ones were served: dropped unanswered at the read bound
            assert sock.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()


def test_a_client_trickling_its_request_is_dropped_at_the_bound(service: PlanService) -> None:
    with _connect(service) as sock:
        began = time.monotonic()
        ended = b"x"
        while ended and time.monotonic() - began < 10:
            try:
                sock.sendall(b"{")  # a byte at a time, never a whole line
            except OSError:
                break
            sock.settimeout(0.2)
            try:
                ended = sock.recv(1)
            except TimeoutError:
                continue
        assert time.monotonic() - began < 5  # the read bound is for the whole request
    assert _ask(service) == {"answer": "plan"}
