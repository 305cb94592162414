"""The smol backend's exec output stays within its cap whatever the guest does after the trim.

On a local microVM an exec's output goes to files in the guest, trimmed there to the cap; a
process the command left running can grow a file again before the host reads it (issue 23.7).
No microVM boots on this project's machines, so the machine here is a stand-in that answers
``read_file`` with what such a guest would leave: the code under test is the host's reading.
"""

from __future__ import annotations

from typing import Any

from pytest_smolvm.backends.smol.guest import SmolGuest


class _GrownAfterTheTrim:
    def read_file(self, path: str) -> bytes:
        return b"y" * (8 << 20)


def test_output_grown_after_the_trim_is_cut_on_the_host() -> None:
    machine: Any = _GrownAfterTheTrim()
    guest = SmolGuest(machine, name="g", target="local", source=None, env={}, owned=False)
    data, cut = guest._read_output("/tmp/out", 4096, 0, required=True)  # the trim said: nothing dropped
    assert cut and len(data) < 2 * 4096
