"""What the user reads: the report header and the closing summary (guest logs: artifacts.py)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pytest_smolvm.baseline import preparations

if TYPE_CHECKING:
    from pytest_smolvm.lifecycle import SmolSession
    from pytest_smolvm.registry import Record



def header_lines(session: SmolSession) -> list[str]:
    base = session.default_baseline
    lines = [
        f"smolvm: backend {session.selection.name} "
        f"(isolation: {session.backend_cls.isolation}; {session.selection.reason})",
        f"smolvm: baseline {base.reference} ({base.kind}, {base.digest})",
    ]
    if base.kind in ("bundled", "rootfs-tar", "image-archive") or (base.kind == "registry" and base.path):
        done = preparations(base.digest)
        if done:
            last = done[-1]
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(last["at"]))
            lines.append(f"smolvm: baseline unpacked once on this host by {last['worker']} (pid {last['pid']}) "
                         f"in {last['seconds']:.2f}s at {when}; every guest reuses it")
        else:
            lines.append("smolvm: baseline not unpacked on this host yet: the first guest unpacks it, once, "
                         "while other workers wait")
    describe = getattr(session.backend_cls, "describe_host", None)
    if callable(describe):
        lines.extend(f"smolvm: {line}" for line in describe())
    return lines


def summary_lines(session: SmolSession, kept: Iterable[Record], *, used_guests: bool) -> list[str]:
    lines = []
    if used_guests and session.backend_cls.isolation == "namespace":
        lines.append(f"guests ran on the namespace backend: {session.selection.reason}")
    kept = list(kept)
    if kept:
        lines.append(f"{len(kept)} guest(s) kept alive for debugging:")
        for record in kept:
            lines.append(f"  {record.name}  ({record.test_id})  enter: pytest-smolvm shell {record.name}")
        lines.append("  remove them with: pytest-smolvm reap --kept")
    return lines
