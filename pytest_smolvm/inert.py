"""Guest text made inert before it reaches a terminal, a CI log, JUnit XML or an HTML report.

A guest's output is the attacker's: an escape sequence in it is interpreted by whatever shows
it (an OSC 52 write to the user's clipboard, a cleared screen, a changed window title, a
cursor that hides lines above it). Every control character but newline and tab is shown as
its escape (``\\x1b``), and so is every bidirectional override (``\\u202e``); the text stays
readable and nothing in it acts.
"""

from __future__ import annotations

_CONTROLS = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]  # C0, DEL and C1 (0x9b is CSI on its own)
# Bidirectional overrides, embeddings and isolates: they act too, reordering what is shown
# around them ("Trojan Source", CVE-2021-42574), so a line can read as something it is not.
_BIDI = [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPES = {code: f"\\x{code:02x}" for code in _CONTROLS if code not in (0x09, 0x0A)}
_ESCAPES |= {code: f"\\u{code:04x}" for code in _BIDI}


def inert(text: str) -> str:
    """``text`` with every control character other than newline and tab, and every bidirectional
    override, escaped."""
    return text.translate(_ESCAPES)
