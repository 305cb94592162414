"""What the user reads at the end of a run that used guests (guest logs: artifacts.py).

There is no report-header line: the header is printed before any test runs, when nothing has
been decided yet (the run's plan is made on the first guest request), and a project that never
uses a guest must not see the plugin at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_smolvm.handle.base import GuestHandle
    from pytest_smolvm.host.registry import Record
    from pytest_smolvm.session.plan import RunPlan


def plan_lines(plan: RunPlan) -> list[str]:
    """The run's one decision, and why: backend, isolation, baseline and its digest."""
    from pytest_smolvm.backends import backend_class
    from pytest_smolvm.baselines.cache import preparations

    base = plan.baseline
    lines = [f"smolvm: backend {plan.backend} (isolation: {plan.isolation}; {plan.reason})",
             f"smolvm: baseline {base.reference} ({base.kind}, {base.digest})"]
    done = preparations(base.digest)
    if done:
        last = done[-1]
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(last["at"]))
        lines.append(f"smolvm: baseline unpacked once on this host by {last['worker']} (pid {last['pid']}) "
                     f"in {last['seconds']:.2f}s at {when}; every guest reuses it")
    describe = getattr(backend_class(plan.backend), "describe_host", None)
    if callable(describe):
        lines.extend(f"smolvm: {line}" for line in describe())
    return lines


def summary_lines(plan: RunPlan, kept: Iterable[Record], *,
                  problems: Iterable[str] = (), work: Iterable[str] = ()) -> list[str]:
    lines = plan_lines(plan)
    lines += work  # pulls and unpacks that took long (progress.py): said here, not mid-output
    kept = list(kept)
    if kept:
        lines.append(f"{len(kept)} guest(s) kept alive for debugging:")
        for record in kept:
            lines.append(f"  {record.name}  ({record.test_id})  enter: pytest-smolvm shell {record.name}")
        lines.append("  remove them with: pytest-smolvm reap --kept")
    for problem in problems:
        lines.append(f"teardown problem (left to 'pytest-smolvm reap'): {problem}")
    return lines


def admission_lines(*seen: dict[str, list[int]]) -> list[str]:
    """The peak of guests held host-wide under admission control, as the run's processes saw it."""
    merged: dict[str, list[int]] = {}
    for peaks in seen:
        for gate, (peak, bound) in peaks.items():
            known = merged.setdefault(gate, [0, bound])
            known[0] = max(known[0], peak)
    if not merged:
        return []
    parts = [f"{peak} of {bound} {gate}" for gate, (peak, bound) in sorted(merged.items())]
    return [f"smolvm: admission: peak held on this host: {', '.join(parts)} (guests alive / being created at once)"]


def _bytes(count: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count} bytes"


def cut_output_note(vms: Iterable[GuestHandle]) -> str | None:
    """One line for a test whose guests had an exec's output cut at the output limit, else None.

    A cut stream is named in ``ExecResult.truncated`` and in the transcript's headings, which a
    passing test never shows: without this, 100 MB cut to 16 MiB passes with nothing said.
    """
    cut = [(vm, entry) for vm in vms for entry in vm.transcript if entry.truncated]
    if not cut:
        return None
    vm, first = cut[0]
    command = first.command if len(first.command) <= 60 else first.command[:57] + "..."
    more = f" (and {len(cut) - 1} more)" if len(cut) > 1 else ""
    return (f"smolvm: exec {command!r}{more}: its {' and '.join(first.truncated)} was cut at the output limit, "
            f"{_bytes(vm.output_limit)}, keeping its first and last halves; raise it with --smol-output-limit "
            "or @pytest.mark.smol(output_limit=...) (ExecResult.truncated names the cut streams)")
