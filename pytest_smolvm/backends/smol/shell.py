"""``pytest-smolvm shell`` for a kept smol machine: commands through the SDK's exec stream.

The SDK has no interactive stdin (``ExecOptions.stdin`` is text sent whole, then closed), so
the shell is line by line: each line runs as ``/bin/sh -c LINE`` in the machine, its output
streamed back as it comes. The working directory is carried from one line to the next.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smol import Machine

# Runs the line in the last directory, then reports the directory it ended in on stderr.
_LINE = 'cd "$1" 2>/dev/null; eval "$2"; rc=$?; printf "%s%s\\n" "$3" "$PWD" >&2; exit $rc'


def connect(data: Mapping[str, Any]) -> Machine:
    from smol import ConnectOptions, Machine

    target = str(data.get("target") or "local")
    ident = str(data.get("id") if target == "cloud" and data.get("id") else data.get("name"))
    return Machine.connect(ident, ConnectOptions(target="cloud" if target == "cloud" else "local"))


class _Stderr:
    """The command's stderr, line by line (events split anywhere), with the cwd report taken out."""

    def __init__(self, err: IO[str], marker: str) -> None:
        self.err, self.marker, self.pending, self.cwd = err, marker, "", ""

    def feed(self, data: str) -> None:
        if not self.marker:
            self.err.write(data)
        else:
            *lines, self.pending = (self.pending + data).split("\n")
            for line in lines:
                self._line(line)
        self.err.flush()

    def _line(self, line: str) -> None:
        before, found, after = line.partition(self.marker)
        if found:
            self.cwd = after
            line = before  # what the command left unterminated
            if not line:
                return
        self.err.write(line + "\n")

    def close(self) -> None:
        if self.pending:
            self._line(self.pending)
            self.pending = ""
        self.err.flush()


def run(machine: Machine, argv: list[str], out: IO[str], err: IO[str], marker: str = "") -> tuple[int, str]:
    """Stream one command's output; returns (exit code, the cwd it reported after ``marker``)."""
    exit_code = 1
    errors = _Stderr(err, marker)
    with machine.exec_stream(argv) as stream:
        for event in stream:
            kind = event.get("kind")
            if kind == "stdout":
                out.write(event["data"])
                out.flush()
            elif kind == "stderr":
                errors.feed(str(event["data"]))
            elif kind == "exit":
                exit_code = int(event["exit_code"])
            elif kind == "error":
                err.write(f"pytest-smolvm shell: {event.get('message')}\n")
    errors.close()
    return exit_code, errors.cwd


def shell(data: Mapping[str, Any], command: Sequence[str], *, stdin: IO[str] = sys.stdin,
          out: IO[str] = sys.stdout, err: IO[str] = sys.stderr) -> int:
    from smol import SmolError

    name = str(data.get("name"))
    try:
        machine = connect(data)
        if command:
            return run(machine, list(command), out, err)[0]
        marker = "\x1epytest-smolvm-cwd="
        cwd, status = "/", 0
        if stdin.isatty():
            err.write(f"{name}: each line runs in /bin/sh -c (no terminal: the smol SDK streams "
                      "output but takes no interactive input); exit or Ctrl-D to leave\n")
        while True:
            if stdin.isatty():
                err.write(f"{name}:{cwd}# ")
                err.flush()
            line = stdin.readline()
            if not line or line.strip() in ("exit", "logout"):
                return status
            if not line.strip():
                continue
            status, new_cwd = run(machine, ["/bin/sh", "-c", _LINE, "sh", cwd, line, marker], out, err, marker)
            cwd = new_cwd or cwd
    except SmolError as exc:
        err.write(f"pytest-smolvm shell: {name}: [{exc.code}] {exc.message}\n")
        return 2
