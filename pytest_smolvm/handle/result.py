"""What a guest command produced, and the transcript of a guest's commands: plain values."""

from __future__ import annotations

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
    command: str
    exit_code: int | None
    duration: float
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    error: str = ""
    truncated: tuple[str, ...] = ()

    def render(self) -> str:
        status = ("TIMED OUT" if self.timed_out else f"exit {self.exit_code}"
                  if self.exit_code is not None else f"error: {self.error}")
        lines = [f"$ {self.command}    [{status}, {self.duration:.3f}s]"]
        for label, text in (("stdout", self.stdout), ("stderr", self.stderr)):
            if text:
                lines.append(f"  --- {label} (tail{_CUT if label in self.truncated else ''})")
                lines.extend("  " + line for line in _tail(text).splitlines())
        return "\n".join(lines)


