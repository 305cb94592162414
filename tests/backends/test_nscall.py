"""The namespace backend's request channel, host side: the parts no guest is needed to show."""

from __future__ import annotations

import os
import socket

from pytest_smolvm.backends.namespace.channel import _Call


def _call() -> _Call:
    ours, _theirs = socket.socketpair()
    call = _Call(None, ours, "g", None, -1, -1, -1, 1 << 10, None, None)  # type: ignore[arg-type]
    call.wake_r, call.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    return call


def test_a_cancel_racing_the_end_of_a_call_never_raises() -> None:
    """A copy_out whose consumer refuses the stream cancels the call from another thread,
    sometimes just as the call ends: the wake-up must not kill that thread (it did, with
    BrokenPipeError, when the pipe's reader was already closed)."""
    call = _call()
    os.close(call.wake_r)  # the call is ending: its reader is gone, its writer not yet
    call.wake_r = -1
    call._wake()
    call.close()
    call._wake()  # and once it has ended: nothing to wake
