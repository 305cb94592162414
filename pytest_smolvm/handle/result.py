"""What a guest command produced, and the transcript of a guest's commands: plain values."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Final

from pytest_smolvm.errors import ExecError
from pytest_smolvm.inert import inert

TRANSCRIPT_TAIL = 2000


# The data holds only bytes the guest wrote (a cut stream is its head and its tail, joined):
# where people read it, the cut is said beside it.
_CUT = "; the stream was cut at the output limit: its middle is not kept"


def _tail(text: str, limit: int = TRANSCRIPT_TAIL) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} chars]\n" + text[-limit:]


class _Omitted:
    """The type of :data:`DEFAULT`: ``timeout`` not given, as distinct from ``timeout=None``."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Final = _Omitted()
Timeout = float | None | _Omitted


@dataclass(frozen=True)
class ExecResult:
    """What one ``exec`` produced. ``stdout``/``stderr`` are text (undecodable bytes replaced)."""

    command: str
    exit_code: int
    stdout: str
    stderr: str
    duration: float
    timed_out: bool = False
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)
    truncated: tuple[str, ...] = ()  # the streams ("stdout", "stderr") cut at the output limit

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> ExecResult:
        """Raise :class:`ExecError` unless the command exited 0 in time; returns self."""
        if not self.ok:
            what = "timed out" if self.timed_out else f"exited {self.exit_code}"
            raise ExecError(  # its message reaches the terminal and JUnit: the guest's text made inert
                f"guest command {what}: {self.command}\n"
                f"--- stdout (tail{_CUT if 'stdout' in self.truncated else ''})\n{inert(_tail(self.stdout))}\n"
                f"--- stderr (tail{_CUT if 'stderr' in self.truncated else ''})\n{inert(_tail(self.stderr))}",
                self)
        return self


@dataclass
class TranscriptEntry:
    """One exec, entered when the command is sent (so that a command that never returns, one
    interrupted by a signal, a KeyboardInterrupt or a cancel, is in the transcript too) and
    completed when it ends. ``started`` is set while it runs (``time.monotonic()`` at the start),
    ``None`` once it ended; ``interrupted`` names what stopped the wait (the command itself may
    still run in the guest until the guest is destroyed)."""

    command: str
    exit_code: int | None
    duration: float
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    error: str = ""
    truncated: tuple[str, ...] = ()
    cancelled: bool = False
    interrupted: str = ""
    started: float | None = None

    def interrupted_by(self, exc: BaseException) -> None:
        """Its wait ended in ``exc``: the guest's error, or what stopped the wait (the command
        may still run in the guest)."""
        self.duration = time.monotonic() - (self.started or time.monotonic())
        if isinstance(exc, Exception):
            self.error = str(exc)
        else:  # not the guest's answer: Failed from pytest-timeout, a KeyboardInterrupt, a cancel
            self.interrupted = interruption(exc)
        self.started = None

    def ended(self, result: ExecResult, *, cancelled: bool) -> None:
        self.exit_code, self.duration, self.timed_out = result.exit_code, result.duration, result.timed_out
        self.stdout, self.stderr, self.truncated = _tail(result.stdout), _tail(result.stderr), result.truncated
        if cancelled:
            self.cancelled, self.error = True, "cancelled"
        self.started = None

    def render(self) -> str:
        if self.started is not None:
            status = f"still running, {time.monotonic() - self.started:.3f}s so far"
        else:
            if self.timed_out:
                status = "TIMED OUT"
            elif self.interrupted:
                status = f"INTERRUPTED by {self.interrupted}"
            elif self.cancelled:
                status = f"CANCELLED, exit {self.exit_code}"
            elif self.exit_code is not None:
                status = f"exit {self.exit_code}"
            else:
                status = f"error: {self.error}"
            status = f"{status}, {self.duration:.3f}s"
        lines = [f"$ {self.command}    [{status}]"]
        for label, text in (("stdout", self.stdout), ("stderr", self.stderr)):
            if text:
                lines.append(f"  --- {label} (tail{_CUT if label in self.truncated else ''})")
                lines.extend("  " + line for line in _tail(text).splitlines())
        return "\n".join(lines)


def interruption(exc: BaseException) -> str:
    """What interrupted an exec's wait, in one line: ``Failed: Timeout (>2.0s) from pytest-timeout``."""
    first = next(iter(str(exc).strip().splitlines()), "").rstrip(".")
    if len(first) > 200:
        first = first[:200] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
