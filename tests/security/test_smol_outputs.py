"""The smol backend takes a guest's bytes as they arrive and stops at its cap (issue 23.7).

A guest can grow a file after the host looked at its size, or after an exec's in-guest trim;
it can also answer with anything at all. No microVM boots on this project's machines, so the
machine here is a stand-in that answers as such a guest would: an endless exec stream (and, for
the code this replaced, an 8 MiB ``read_file``). The code under test is the host's reading; the
same reads against real guests of the loopback cloud are in ``tests/backends/test_conformance.py``
(``test_a_read_past_its_cap_holds_no_more_than_the_cap``). A flood of exec output goes through the
plugin to a loopback cloud guest, whose node the SDK reads as a resumable exec (1.37.3).
"""

from __future__ import annotations

import base64
import io
import itertools
import tarfile
from collections.abc import Iterator
from typing import IO, Any

import pytest

from pytest_smolvm.backends.smol.guest import SmolGuest
from pytest_smolvm.backends.smol.streamed_read import HEADER_MAX, GuestBytes, OverCap
from pytest_smolvm.errors import GuestError
from tests.smolcloud.harness import LoopbackCloud

PIECE = 64 << 10  # characters per stdout event the stand-in sends
SMOL = ["--smol-backend=smol", "--smol-target=cloud", "--smol-baseline=alpine", "-p", "no:cacheprovider"]


class _Stream:
    def __init__(self, events: Iterator[dict[str, Any]], machine: _HostileGuest) -> None:
        self._events, self._machine = events, machine

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for event in self._events:
            if self._machine.killed:
                return
            self._machine.sent += len(str(event.get("data", "")))
            yield event

    def kill(self) -> None:
        self._machine.killed = True

    def close(self) -> None:
        self._machine.killed = True


class _HostileGuest:
    """Answers every exec stream with ``header`` and then ``body`` (endless unless it ends)."""

    def __init__(self, header: str, body: Iterator[str], *, exit_code: int | None = 0) -> None:
        self.header, self.body, self.exit_code = header, body, exit_code
        self.sent = 0  # characters and bytes the host took from this guest
        self.killed = False

    def exec_stream(self, command: list[str], opts: Any) -> _Stream:
        def events() -> Iterator[dict[str, Any]]:
            yield {"kind": "stdout", "data": self.header}
            for piece in self.body:
                yield {"kind": "stdout", "data": piece}
            if self.exit_code is not None:
                yield {"kind": "exit", "exit_code": self.exit_code}
        return _Stream(events(), self)

    def read_file(self, path: str) -> bytes:  # what the SDK's whole-file read would hand over
        self.sent += 8 << 20
        return b"y" * (8 << 20)


def _endless(piece: str = base64.b64encode(b"y" * (PIECE // 4 * 3)).decode()) -> Iterator[str]:
    return itertools.repeat(piece)


def test_output_grown_after_the_trim_is_cut_as_it_arrives() -> None:
    machine = _HostileGuest("file\n", _endless())
    guest = SmolGuest(machine, name="g", target="local", source=None, env={}, owned=False)  # type: ignore[arg-type]
    data, cut = guest._read_output("/tmp/out", 4096, 0, required=True)  # the trim said: nothing dropped
    assert cut and data == b"y" * 4096
    assert machine.sent <= 4096 + 2 * PIECE and machine.killed


def test_read_file_past_max_bytes_takes_no_more_than_the_cap() -> None:
    machine = _HostileGuest("file\n", _endless())
    guest = SmolGuest(machine, name="g", target="local", source=None, env={}, owned=False)  # type: ignore[arg-type]
    with pytest.raises(OSError, match="max_bytes=100000"):
        guest.read_file("/etc/hostname", max_bytes=100_000)
    assert machine.sent <= 100_000 + 2 * PIECE and machine.killed


def test_a_header_that_never_ends_is_refused() -> None:
    machine = _HostileGuest("x", _endless("x" * PIECE))
    with (GuestBytes(machine, "", [], name="g", what="read") as answer,  # type: ignore[arg-type]
          pytest.raises(GuestError, match="no header line")):
        answer.header()
    assert machine.sent <= HEADER_MAX + 2 * PIECE


def test_line_breaks_and_padding_with_no_data_count_against_the_cap() -> None:
    machine = _HostileGuest("file\n", _endless("\n" * PIECE))
    with GuestBytes(machine, "", [], name="g", what="read") as answer:  # type: ignore[arg-type]
        answer.header()
        with pytest.raises(OverCap):
            answer.pour(io.BytesIO().write, 1000)
    assert machine.sent <= 2 * 1000 + (1 << 16) + 2 * PIECE


@pytest.mark.parametrize("exit_code", [1, None], ids=["failed", "no-exit-status"])
def test_a_whole_looking_tree_from_a_failed_stream_is_not_kept(exit_code: int | None) -> None:
    """The stream broke (or the guest's command failed) after a tree that reads as complete:
    the copy fails, so the caller keeps none of it."""
    tree = io.BytesIO()
    with tarfile.open(fileobj=tree, mode="w") as tar:
        info = tarfile.TarInfo("./f")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    machine = _HostileGuest("dir\n", iter([base64.b64encode(tree.getvalue()).decode()]), exit_code=exit_code)
    guest = SmolGuest(machine, name="g", target="cloud", source=None, env={}, owned=False)  # type: ignore[arg-type]
    guest._sh = lambda *args, **kwargs: None  # type: ignore[method-assign]  # the cleanup of the staged tar
    taken: list[bytes] = []

    def consume(stream: IO[bytes]) -> None:
        taken.append(stream.read())

    with pytest.raises(GuestError):
        guest.get_archive("/work/t", "payload", consume)
    assert taken == [tree.getvalue()]  # consume saw all of it, and the call still failed


def test_a_flood_of_output_holds_only_its_cap_in_host_memory(pytester: pytest.Pytester, cloud: LoopbackCloud,
                                                              token: str) -> None:
    """The SDK's resumable exec kept every byte a command printed before the plugin's cap
    applied (and failed the exec where the node had dropped some): 200 MB of output cost the
    host 200 MB. Now each stream's head and tail are all that is held while it reads on."""
    pytester.makeconftest("""
        import dataclasses
        from pytest_smolvm import limits
        limits.LIMITS = dataclasses.replace(limits.LIMITS, output_bytes=1 << 20)
    """)
    pytester.makepyfile("""
        import resource

        def test_flood(smol_vm):
            smol_vm.exec("true")
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            result = smol_vm.exec("head -c 200000000 /dev/zero; echo end >&2")
            grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
            assert result.exit_code == 0 and "stdout" in result.truncated, result
            assert len(result.stdout_bytes) <= 1 << 20 and set(result.stdout_bytes) == {0}
            assert result.stderr.endswith("end\\n")
            assert grown < 64, f"the host grew by {grown} MiB"
    """)
    result = pytester.runpytest_subprocess(*SMOL, timeout=300)
    result.assert_outcomes(passed=1)
    assert cloud.wait_for_no_machines(token=token) == []
