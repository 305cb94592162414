"""Ctrl-C, SIGTERM and SIGHUP while a destroy runs: held until it is done, whichever thread
the kernel hands them to.

A process-directed signal goes to any thread that does not block it, and CPython then runs
the Python handler in the main thread at its next bytecode. Blocking the signals in the main
thread alone defers nothing: the kernel hands them to another thread (the pool's teardown
thread, a made-ahead create, the plan service, an aio call, an SDK's own threads) and the
KeyboardInterrupt still lands in the middle of the destroy. So the deferral swaps the
*handlers*, the one place every delivery ends up, notes what arrived and raises it again
once the destroy is over. The threads the plugin starts also block the three signals, so
the kernel hands them to the main thread where it can.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_held: list[int] = []  # what arrived while deferred, once each, in order
_depth = 0  # signals_deferred nesting in the main thread (close() holds destroy())
_replaced: dict[int, Any] = {}  # the handler _hold replaced, by signal: see _previous


def _hold(signum: int, _frame: FrameType | None) -> None:
    if signum not in _held:
        _held.append(signum)


def _previous(sig: signal.Signals) -> Any:
    """The handler in place, or, where an interrupt cut a restore short and left ``_hold``
    there, the one ``_hold`` had replaced: never ``_hold`` itself, which would swallow the
    signal for the rest of the process."""
    handler = signal.getsignal(sig)
    return _replaced.get(sig, signal.SIG_DFL) if handler is _hold else handler


def _restore(handlers: list[tuple[signal.Signals, Any]]) -> None:
    """Put ``handlers`` back, each in the ``finally`` of the one before: a signal whose own
    handler raises the moment it is back (Ctrl-C) cannot leave the others holding."""
    if not handlers:
        return
    (sig, handler), rest = handlers[0], handlers[1:]
    try:
        signal.signal(sig, handler)
    finally:
        _restore(rest)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP until the block ends, then deliver each once, in order.

    Only the main thread runs Python signal handlers, so only there is anything to hold;
    elsewhere this does nothing. Whatever the block waits for must be bounded: the interrupt
    is late by that much.
    """
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    if _depth > 1:
        try:
            yield
        finally:
            _depth -= 1
        return
    previous: dict[signal.Signals, Any] = {}
    try:
        _held.clear()  # nothing a cut-short end left behind is delivered twice
        for sig in DEFERRED_SIGNALS:
            handler = _previous(sig)
            if handler is signal.SIG_IGN or handler is None:
                continue  # ignored (nohup), or not Python's to handle: left as it is
            _replaced[sig] = handler
            previous[sig] = handler
            signal.signal(sig, _hold)
        yield
    finally:
        # The depth first: a signal landing once the handlers are back raises right here, and
        # a depth left at 1 turned every later deferral into a nested one that defers nothing.
        _depth = 0
        _restore(list(previous.items()))
        held = [s for s in _held if s in previous]
        _held.clear()
        for s in held:  # to this thread, with its own handlers back: Ctrl-C raises right here
            signal.raise_signal(s)


def start_thread(target: Callable[..., object], *, name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon thread that never takes SIGINT/SIGTERM/SIGHUP for the process."""
    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED_SIGNALS)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
