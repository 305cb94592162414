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


def test_a_writer_left_behind_cannot_hold_exec_past_the_exit() -> None:
    """After the exit status, exec takes what the pipes hold then, and returns: a process the
    command left behind (here host `dd`s, sacrificial) refills them as fast as they are read,
    and the old drain read on until it happened to find them empty (a background `yes` in a
    guest kept exec past its timeout that way)."""
    import subprocess
    import threading
    import time

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    writers = [subprocess.Popen(["dd", "if=/dev/zero", "bs=1M"], stdout=out_w, stderr=subprocess.DEVNULL)
               for _ in range(4)]
    os.close(out_w)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.send(b'{"pid": 12345}')
    theirs.send(b'{"exit": 0}')
    read: list[int] = []

    def seen(_stream: str, data: bytes) -> None:  # an on_output callback that takes a moment per chunk
        read.append(len(data))
        time.sleep(0.001)

    call = _Call(None, ours, "g", None, -1, out_r, err_r, 16 << 20, seen, None)  # type: ignore[arg-type]
    outcome: list[object] = []
    waiter = threading.Thread(target=lambda: outcome.append(call.wait(30, None)), daemon=True)
    try:
        time.sleep(0.2)  # the writers are running when the exit status is read
        waiter.start()
        waiter.join(20)
        assert outcome, "exec still draining a pipe that a left-behind writer keeps full"
        # At most what a pipe holds (1 MiB without CAP_SYS_RESOURCE): never what came after.
        assert sum(read) <= 1 << 20, f"{sum(read)} bytes read after the command had exited"
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
        waiter.join(5)
        if not waiter.is_alive():
            call.close()
        os.close(err_w)
        theirs.close()
