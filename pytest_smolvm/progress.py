"""Progress lines for long host-side work (pulling an image, unpacking a baseline).

Nothing is printed for work that finishes within a second. Only the process doing the work
prints (the others wait on its file lock), so a pull shows once per host even under ``-n``.
The plugin points the lines at the real terminal (past pytest's capture), or turns them off
with ``-q``; elsewhere (the ``pytest-smolvm`` command) they go to stderr.
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


def set_sink(sink: Sink | None) -> None:
    """Where progress lines go; None silences them."""
    global _sink
    _sink = sink


def reset() -> None:
    set_sink(_stderr)


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
        if (self.shown or elapsed >= QUIET_FOR) and _sink is not None:
            _sink(f"smolvm: {self.title}: {summary} in {elapsed:.1f}s")


def install(config: pytest.Config) -> None:
    """Progress lines to the real terminal, past pytest's capture; none with ``-q``."""
    if config.get_verbosity() < 0:
        set_sink(None)
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    is_worker = hasattr(config, "workerinput")  # an xdist worker's stderr is the controller's terminal

    def write(line: str) -> None:
        reporter = None if is_worker else config.pluginmanager.getplugin("terminalreporter")
        if capman is None:
            _stderr(line)
            return
        with capman.global_and_fixture_disabled():
            if reporter is not None:
                reporter.write_line(line)  # starts a fresh line if a test's dots are on this one
            else:
                _stderr(line)

    set_sink(write)
