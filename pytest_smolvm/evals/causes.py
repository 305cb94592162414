"""Why an episode ended as it did (the ``cause`` of a v2 result line; the names are
``results.load.CAUSES``), from what the host saw.

The cause separates failures on the merits from infrastructure: a timeout, a guest process the
kernel killed for memory, an error outside the test body (provisioning, fixture setup or
teardown), a worker that died. It is judged from facts the host measured (the exception's type,
the exec transcript's timed-out flags, the guest cgroup's OOM-kill count), never from text: a
guest that prints "out of memory" does not make its failure look like the infrastructure's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import pytest

from pytest_smolvm.errors import ExecError

if TYPE_CHECKING:
    from pytest_smolvm.session.pool import LiveGuest


def _timed_out(exc: BaseException | None) -> bool:
    if isinstance(exc, ExecError):
        return bool(getattr(exc.result, "timed_out", False))
    # pytest-timeout's signal method fails the test with "Timeout (>Ns) from pytest-timeout." (its
    # thread method kills the worker: a crashed line). pytest.fail is raised by test code and
    # plugins on the host, never by a guest.
    return isinstance(exc, pytest.fail.Exception) and str(exc).startswith("Timeout (>")


def oom_kills(guests: Sequence[LiveGuest]) -> int:
    """Processes the kernel killed for memory in these guests, as far as their backend counts."""
    return sum(int(getattr(live.guest, "oom_kills", 0) or 0) for live in guests)


def of(outcome: str, reports: Mapping[str, pytest.TestReport], errors: Mapping[str, BaseException],
       guests: Sequence[LiveGuest]) -> str:
    """The cause of a test whose phase ``reports`` made ``outcome`` (``errors``: the exception
    of each phase that raised one)."""
    if outcome in ("passed", "xpassed"):
        return "passed"
    if outcome in ("skipped", "xfailed"):
        return "skipped"
    call = reports.get("call")
    if call is None or not call.failed:
        return "setup"  # the error came from setup or teardown: not the test body
    if oom_kills(guests) > 0:
        return "oom"
    if _timed_out(errors.get("call")) or any(entry.timed_out for live in guests for entry in live.vm.transcript):
        return "timeout"
    return "failed"
