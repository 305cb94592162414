"""Reading ``--smol-results`` JSONL files, any schema version this code knows, and naming the
reason an episode did not pass (the outcome breakdown)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pytest_smolvm.errors import ResultsError

KNOWN_VERSIONS = frozenset({1, 2})
CAUSES = ("passed", "failed", "timeout", "oom", "setup", "skipped", "crashed")
# Version 2 lines carry their cause (evals/causes.py, from what the host measured). Version 1
# lines carry none; it is guessed from pytest's outcome and the one-line message.
_TIMEOUT = re.compile(r"timed? ?out|Timeout", re.IGNORECASE)
_OOM = re.compile(r"\bOOM\b|out of memory|killed for memory|oom[-_ ]kill", re.IGNORECASE)
_SETUP = re.compile(r"ProvisionError|provision|UsageError|MarkerError")


def read(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ResultsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    lines = []
    rows = text.splitlines()
    if rows and not text.endswith("\n"):
        rows.pop()  # a torn last line (the host went down mid-write), as lines.read_results does
    for number, raw in enumerate(rows, 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
        if not isinstance(line, dict) or "outcome" not in line or "function" not in line:
            raise ResultsError(f"{path}:{number}: not a pytest-smolvm result line")
        if line.get("v") not in KNOWN_VERSIONS:
            raise ResultsError(f"{path}:{number}: schema version {line.get('v')!r} is not one this "
                               f"pytest-smolvm reads ({', '.join(map(str, sorted(KNOWN_VERSIONS)))})")
        lines.append(line)
    return lines


def cause(line: dict[str, Any]) -> str:
    """Why the episode ended as it did: one of ``CAUSES``."""
    if line.get("v", 1) != 1:  # the line's own cause; its message (guest text) is not read
        return str(line["cause"]) if line.get("cause") in CAUSES else "failed"
    if line.get("crashed"):
        return "crashed"
    outcome, message = line.get("outcome"), str(line.get("message") or "")
    if outcome in ("passed", "xpassed"):
        return "passed"
    if outcome in ("skipped", "xfailed"):
        return "skipped"
    if _OOM.search(message):
        return "oom"
    if _TIMEOUT.search(message):
        return "timeout"
    if outcome == "error" and _SETUP.search(message):
        return "setup"
    return "failed"
