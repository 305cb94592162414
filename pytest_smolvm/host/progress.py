"""Progress lines for long host-side work (pulling an image, unpacking a baseline).

Nothing is printed for work that finishes within a second. Only the process doing the work
prints (the others wait on its file lock), so a pull shows once per host even under ``-n``.
The ``pytest-smolvm`` command prints them to stderr as the work goes on. A pytest run prints no
live line: the work happens inside the setup of whichever test asked first, often on another
thread or in an xdist worker, so a line would land in the middle of the test output. There the
closing lines are kept for the run's ``smolvm`` summary section instead (none with ``-q``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

QUIET_FOR = 1.0  # seconds of work before the first line
EVERY = 2.0  # seconds between lines after that

Sink = Callable[[str], None]


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


_sink: Sink | None = _stderr
_finished: list[str] | None = None  # in a pytest run: the closing lines, for the summary


def set_sink(sink: Sink | None) -> None:
    """Where live progress lines go; None silences them."""
    global _sink
    _sink = sink


def keep(line: str) -> None:
    """A line for the run's summary (once, however often it is kept), like a long work's last."""
    if _finished is not None and line not in _finished:
        _finished.append(line)


def reset() -> None:
    global _finished
    set_sink(_stderr)
    _finished = None


def finished() -> list[str]:
    """The closing lines of this process's long work so far (a pytest run only)."""
    return list(_finished or ())


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Progress:
    """``update()`` as work goes on; a line is printed only once the work has taken a second."""

    def __init__(self, title: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.title = title
        self._clock = clock
        self.started = clock()
        self._next = self.started + QUIET_FOR
        self.shown = False

    def update(self, state: str) -> None:
        now = self._clock()
        if now >= self._next and _sink is not None:
            _sink(f"smolvm: {self.title}: {state} ({now - self.started:.0f}s)")
            self.shown = True
            self._next = now + EVERY

    def done(self, summary: str) -> None:
        """The closing line, printed only if the work was long enough to be shown at all."""
        elapsed = self._clock() - self.started
        if not (self.shown or elapsed >= QUIET_FOR):
            return
        line = f"smolvm: {self.title}: {summary} in {elapsed:.1f}s"
        if _finished is not None:
            _finished.append(line)
        if _sink is not None:
            _sink(line)


def install(config: pytest.Config) -> None:
    """A pytest run: no live lines; the closing ones kept for the summary, unless ``-q``."""
    global _finished
    set_sink(None)
    _finished = [] if config.get_verbosity() >= 0 else None
