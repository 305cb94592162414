"""Guest bytes reach the host a piece at a time, counted as they arrive, and never past a cap.

The SDK's ``read_file`` returns a file whole: locally up to the engine's 4 GiB transfer cap, on
the cloud as one response read to its end (``transport.py``: ``read_file``, ``_cloud_fetch``).
A guest can grow a file after the host has looked at its size, or after an exec's in-guest
trim, so a check made before or after such a read comes too late for the host's memory (issue
23.7). An exec stream is the SDK's one call whose output the host takes in pieces and can stop:
``ExecStream.kill`` ends it. Its data is text, so the bytes travel as base64, which is ASCII
and passes the SDK's lossy decoding unchanged.

Every script run here prints one header line first (what the path is; for a file, its mode and
size), then the base64. The guest may print anything instead: the header is bounded and the
payload is refused past its cap, whatever the guest's own ``base64`` does.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from pytest_smolvm.backends.output import BoundedBuffer
from pytest_smolvm.backends.smol.common import _describe, exec_error
from pytest_smolvm.backends.smol.sdk import exec_bounded
from pytest_smolvm.errors import GuestError

if TYPE_CHECKING:
    from smol import Machine

HEADER_MAX = 256  # characters of a header line
STDERR_KEPT = 4096
# Sets $w to base64's no-wrap flag where the guest's base64 has one: one long line travels as
# one event, not one per 76 characters. The host ignores line breaks either way.
NO_WRAP = 'w=; base64 -w 0 </dev/null >/dev/null 2>&1 && w="-w 0"\n'
# File $1's bytes, header "file": opened before the header, so a missing or unreadable file
# fails the command (and its status says which) with nothing printed.
READ_SCRIPT = NO_WRAP + 'exec <"$1" || exit 1\necho file\nexec base64 $w\n'


class StreamFailed(GuestError):
    """The guest's command ended with a status other than 0 (or without one); ``stderr`` is its
    error output, which callers read for why."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


class OverCap(GuestError):
    """More bytes came than the cap allows; those up to the cap were delivered."""


class GuestBytes:
    """One exec stream of a script that prints a header line, then base64."""

    def __init__(self, machine: Machine, script: str, args: Sequence[str], *, name: str, what: str,
                 user: str | None = None, timeout: float | None = None) -> None:
        from smol import ExecOptions, SmolError

        self.what = f"{what} in {name}"  # how errors name this transfer
        try:
            with exec_bounded(timeout, None, resumable=False):  # no hole in a transfer (sdk.py)
                self._stream = machine.exec_stream(["/bin/sh", "-c", script, "pytest-smolvm", *args],
                                                   ExecOptions(timeout=timeout, user=user))
        except SmolError as exc:
            raise (exec_error(exc, name, user) if user is not None
                   else GuestError(f"{what} in {name}: {_describe(exc)}")) from exc
        self._events: Iterator[dict[str, Any]] = iter(self._stream)
        self._pending = ""  # stdout already received and not yet used
        self._stderr = BoundedBuffer(STDERR_KEPT)
        self._exit: int | None = None

    def __enter__(self) -> GuestBytes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kill(self) -> None:
        """End the command if it is still running; safe from another thread (``ExecStream.kill`` is)."""
        try:
            self._stream.kill()
        except Exception:  # a stream that already ended has nothing to end
            pass

    def close(self) -> None:
        """Kill, then let go of the stream: from the thread that reads it, or once it is done."""
        self.kill()
        try:
            self._stream.close()
        except Exception:
            pass

    def header(self) -> str:
        while "\n" not in self._pending:
            if len(self._pending) > HEADER_MAX:
                raise GuestError(f"{self.what}: the guest's answer has no header line")
            piece = self._next_stdout()
            if piece is None:
                raise self._failure()
            self._pending += piece
        line, _, self._pending = self._pending.partition("\n")
        return line

    def pour(self, write: Callable[[bytes], object], limit: int) -> int:
        """The rest, decoded into ``write``; returns how many bytes. Past ``limit`` the bytes up to
        it are written and :class:`OverCap` raised; a failed command raises :class:`StreamFailed`."""
        rest = ""  # base64 characters short of a whole group of four
        total = received = 0
        piece: str | None = self._pending
        self._pending = ""
        while piece is not None:
            received += len(piece)
            if received > 2 * limit + (1 << 16):  # line breaks or padding with no data behind them
                raise OverCap(f"{self.what}: more than {limit} bytes; refused")
            text = rest + "".join(piece.split())
            whole = len(text) - len(text) % 4
            rest = text[whole:]
            try:
                data = base64.b64decode(text[:whole], validate=True)
            except binascii.Error as exc:
                raise GuestError(f"{self.what}: undecodable transfer: {exc}") from None
            if total + len(data) > limit:
                write(data[:limit - total])
                raise OverCap(f"{self.what}: more than {limit} bytes; refused")
            if data:
                write(data)
            total += len(data)
            piece = self._next_stdout()
        if rest:
            raise GuestError(f"{self.what}: the transfer ended mid-way")
        if self._exit != 0:
            raise self._failure()
        return total

    def _next_stdout(self) -> str | None:
        """The next piece of stdout; None once the command has ended."""
        from smol import SmolError

        try:
            for event in self._events:
                kind = event.get("kind")
                if kind == "stdout":
                    return str(event.get("data", ""))
                if kind == "stderr":
                    self._stderr.add(str(event.get("data", "")).encode("utf-8", "replace"))
                elif kind == "exit":
                    self._exit = int(event.get("exit_code", -1))
                elif kind == "error":
                    raise GuestError(f"{self.what}: {event.get('message', '')}")
        except SmolError as exc:
            raise GuestError(f"{self.what}: {_describe(exc)}") from exc
        return None

    def _failure(self) -> StreamFailed:
        stderr = self._stderr.value().decode("utf-8", "replace").strip()
        status = "no exit status" if self._exit is None else f"exit {self._exit}"
        detail = stderr.splitlines()[-1] if stderr else status
        return StreamFailed(f"{self.what}: {detail}", stderr)


def read_capped(machine: Machine, path: str, limit: int, *, name: str, what: str,
                user: str | None = None, timeout: float | None = None) -> tuple[bytes, bool]:
    """Guest file ``path``'s bytes up to ``limit``, and whether there were more.

    Raises :class:`StreamFailed` where the file cannot be opened (its stderr says why)."""
    buffer = io.BytesIO()
    with GuestBytes(machine, READ_SCRIPT, [path], name=name, what=what, user=user, timeout=timeout) as answer:
        if answer.header() != "file":
            raise GuestError(f"{what} in {name}: the guest's answer has no file header")
        try:
            answer.pour(buffer.write, limit)
        except OverCap:
            return buffer.getvalue(), True
    return buffer.getvalue(), False


AFTER_CONSUMED = 5.0  # seconds the rest of a stream may take once its reader has all it wanted


def pour_to_reader(answer: GuestBytes, consume: Callable[[IO[bytes]], None], *, limit: int,
                   prefix: bytes = b"", expect: int | None = None, suffix: bytes = b"") -> None:
    """``consume`` reads ``prefix``, the stream's bytes as they arrive, then ``suffix``.

    Through a pipe filled by a thread, so that neither side holds more than the pipe does. With
    ``expect``, exactly that many bytes must come. A failed stream fails the call even where
    ``consume`` took what it saw as a whole; the caller keeps nothing of it.
    """
    read_end, write_end = os.pipe()
    failed: list[BaseException] = []

    def feed() -> None:
        try:
            with open(write_end, "wb") as pipe:
                pipe.write(prefix)
                total = answer.pour(pipe.write, limit)
                if expect is not None and total != expect:
                    raise GuestError(f"{answer.what}: {total} bytes came of the {expect} the guest announced")
                pipe.write(suffix)
        except BrokenPipeError:
            pass  # the reader stopped: its own outcome says why
        except BaseException as exc:
            failed.append(exc)

    feeder = threading.Thread(target=feed, name="smol-stream-feed", daemon=True)
    feeder.start()
    try:
        with open(read_end, "rb") as reader:
            consume(reader)
    except BaseException:
        answer.kill()
        feeder.join()
        raise
    # The reader is closed: a write now fails at once. A guest that keeps its stream open with
    # nothing more to say is ended, and what the reader took stands.
    feeder.join(AFTER_CONSUMED)
    if feeder.is_alive():
        answer.kill()
        feeder.join()
        return
    if failed:
        raise failed[0]
