"""Which backend a run uses, and why: ``auto`` prefers a real microVM, and says so when none boots.

The plan (``session.plan``) asks this once per run; ``pytest-smolvm doctor`` asks it to show
what a run here would pick.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pytest_smolvm.backends import backend_class
from pytest_smolvm.backends.base import ProbeResult
from pytest_smolvm.backends.smol.boot_failures import plain_reason
from pytest_smolvm.errors import UsageError


@dataclass(frozen=True)
class Selection:
    name: str
    reason: str


def select_backend(requested: str, target: str = "local",
                   probe: Callable[[], ProbeResult] | None = None) -> Selection:
    """Decide which backend runs, and say why. ``auto`` prefers a real microVM."""
    if requested != "auto":
        if requested == "smol" and target == "local":
            result = (probe or _probe_smol)()
            if not result.available:
                raise UsageError(f"--smol-backend=smol: no microVM boots on this host: {result.reason} "
                                 "(run 'pytest-smolvm doctor' for the fix)")
        return Selection(requested, f"--smol-backend={requested} was asked for")
    if target == "cloud":
        return Selection("smol", "--smol-target=cloud runs microVMs on smol cloud")
    result = (probe or _probe_smol)()
    if result.available:
        return Selection("smol", "a microVM booted on this host")
    return Selection("namespace", f"no microVM boots here: {plain_reason(result.reason)}; "
                                  "see 'pytest-smolvm doctor'; namespace guests share the host kernel")


def _probe_smol() -> ProbeResult:
    try:
        smol = backend_class("smol")
    except (ImportError, AttributeError) as exc:
        return ProbeResult(False, f"the smol backend is not available: {exc}")
    return smol.probe()
