"""Guest text made inert before it reaches a terminal, a CI log, JUnit XML or an HTML report.

A guest's output is the attacker's: an escape sequence in it is interpreted by whatever shows
it (an OSC 52 write to the user's clipboard, a cleared screen, a changed window title, a
cursor that hides lines above it). Every control character but newline and tab is shown as
its escape (``\\x1b``); the text stays readable and nothing in it acts.
"""

from __future__ import annotations

_CONTROLS = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]  # C0, DEL and C1 (0x9b is CSI on its own)
_ESCAPES = {code: f"\\x{code:02x}" for code in _CONTROLS if code not in (0x09, 0x0A)}


def inert(text: str) -> str:
    """``text`` with every control character other than newline and tab escaped."""
    return text.translate(_ESCAPES)
