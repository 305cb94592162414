"""Failure injection: make the Nth call of an operation fail the way the real service can.

``--fail create:2:503`` makes the second create answer 503 (retryable, as ``_retryable_status``
says of 408/429/502/503/504, transport.py:2164-2165); ``--fail branch:1:429:1`` adds a
``retry-after: 1`` header. ``--fail create:1:drop`` hangs up on the first create before doing
it, ``--fail create:1:lost`` does it and then hangs up: the machine exists, the client never hears
of it; ``--fail branch:1:stall`` never answers (a hung control plane: the connection stays open,
nothing is done, until ``STALL_SECONDS`` or the server's end); ``--fail branch:1:unready`` does
the branch and answers it, but its children never become ready (state ``created``, ``ready``
false: a clone stuck booting, which the SDK's ``_wait_for_ready`` polls for). Counts are per
server, across every token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tests.smolcloud import wire

OPERATIONS = ("create", "start", "branch", "exec", "delete", "list")
RETRYABLE = frozenset({408, 429, 502, 503, 504})
HANG_UPS = ("drop", "lost", "stall")  # no answer: a hang-up before or after the operation, or none at all
UNREADY = "unready"  # the operation is done and answered; what it made never becomes ready
STALL_SECONDS = 600.0


@dataclass(frozen=True)
class Fault:
    operation: str
    nth: int
    status: int
    retry_after: int | None = None
    hang_up: str = ""  # one of HANG_UPS: the connection closes instead of an answer (status is 0)
    unready: bool = False  # answered, but what it made never becomes ready (status is 0)


def parse_fault(text: str) -> Fault:
    """``OP:N:STATUS[:RETRY_AFTER]``; raises ValueError with a one-line reason."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in OPERATIONS:
        raise ValueError(f"--fail {text}: expected OP:N:STATUS[:RETRY_AFTER] with OP one of "
                         f"{', '.join(OPERATIONS)}")
    if len(parts) == 3 and parts[2] == UNREADY and parts[1].isdigit() and int(parts[1]) >= 1:
        if parts[0] != "branch":
            raise ValueError(f"--fail {text}: {UNREADY} applies to branch only")
        return Fault(parts[0], int(parts[1]), 0, unready=True)
    if len(parts) == 3 and parts[2] in HANG_UPS and parts[1].isdigit() and int(parts[1]) >= 1:
        return Fault(parts[0], int(parts[1]), 0, hang_up=parts[2])
    try:
        numbers = [int(p) for p in parts[1:]]
    except ValueError:
        raise ValueError(f"--fail {text}: N, STATUS and RETRY_AFTER must be whole numbers") from None
    if numbers[0] < 1 or not 400 <= numbers[1] <= 599:
        raise ValueError(f"--fail {text}: N must be >= 1 and STATUS an HTTP error status")
    return Fault(parts[0], numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else None)


class Faults:
    def __init__(self, faults: list[Fault]) -> None:
        self._faults = faults
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self.fired: list[Fault] = []
        self._local = threading.local()  # a hang-up due on this handler thread's connection
        self._stop = threading.Event()  # never set: a stalled call waits its STALL_SECONDS

    def check(self, operation: str) -> bool:
        """Raise (or arrange a hang-up) where a fault is due; True where what the call makes
        is to stay unready."""
        with self._lock:
            count = self._counts[operation] = self._counts.get(operation, 0) + 1
            hit = next((f for f in self._faults if f.operation == operation and f.nth == count), None)
            if hit is not None:
                self.fired.append(hit)
        if hit is not None and hit.hang_up == "stall":
            self._stop.wait(STALL_SECONDS)  # the client gives up first, or the server stops
            raise wire.ApiError(503, "injected_failure", f"{operation} call {count} stalled (--fail)")
        if hit is not None and hit.hang_up:
            self._local.hang_up = True
            if hit.hang_up == "drop":
                raise wire.ApiError(503, "injected_failure", f"{operation} call {count} dropped (--fail)")
            return False
        if hit is not None and hit.unready:
            return True
        if hit is not None:
            raise wire.ApiError(hit.status, "injected_failure",
                                f"injected failure of {operation} call {count} (--fail)",
                                retryable=hit.status in RETRYABLE, retry_after=hit.retry_after)
        return False

    def take_hang_up(self) -> bool:
        """Whether this thread's answer is to be a closed connection instead (once)."""
        due = getattr(self._local, "hang_up", False)
        self._local.hang_up = False
        return bool(due)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
