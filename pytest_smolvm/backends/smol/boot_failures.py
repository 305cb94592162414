"""Why no microVM boots here, in words: host facts read without booting, and the engine's errors.

The probe (``probe.py``) decides by booting; this module explains its verdict, for the one-line
reason a pytest run prints and for ``doctor``. Nothing here boots or imports smol.
"""

from __future__ import annotations

import sys
from pathlib import Path

# How a probe that timed out words its reason (``probe.boot``), so a plain reason can recognise it.
TIMEOUT_REASON = "boot did not finish within"


def pvm_evidence() -> str | None:
    """Why this looks like a PVM host (KVM for guests running inside a cloud VM), or None."""
    if Path("/sys/module/kvm_pvm").exists():
        return "the kvm_pvm kernel module is loaded (/sys/module/kvm_pvm)"
    try:
        for line in Path("/proc/modules").read_text().splitlines():
            if line.split(" ", 1)[0] == "kvm_pvm" or "pvm" in line.split(" ", 1)[0]:
                return f"/proc/modules lists {line.split(' ', 1)[0]}"
    except OSError:
        pass
    params = Path("/sys/module/kvm/parameters")
    if params.is_dir():
        names = [p.name for p in params.iterdir() if "pvm" in p.name]
        if names:
            return f"/sys/module/kvm/parameters has {', '.join(sorted(names))}"
    return None


def is_kvm_access_denied(reason: str) -> bool:
    lowered = reason.lower()
    return "kvmopen(error(13))" in lowered or ("permission denied" in lowered and "kvm" in lowered)


def is_oom_adjust_denied(reason: str) -> bool:
    """The engine's monitor could not lower its OOM score: CAP_SYS_RESOURCE is missing (a container)."""
    lowered = reason.lower()
    return "oom_score_adj" in lowered and "permission denied" in lowered


# Linux capability number (linux/capability.h); lowering any process's oom_score_adj needs it.
CAP_SYS_RESOURCE = 24


def has_capability(number: int, status: Path = Path("/proc/self/status")) -> bool | None:
    """Whether this process holds capability ``number`` in its effective set; None where unknown."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> number & 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def plain_reason(reason: str) -> str:
    """The engine's reason for a failed boot, in a few words (the raw text is ``doctor``'s)."""
    if is_kvm_access_denied(reason):
        why = "the VMM may not open /dev/kvm"
    elif is_oom_adjust_denied(reason):
        why = "the VMM lacks CAP_SYS_RESOURCE"  # short: it goes in the summary line
    elif reason.startswith(TIMEOUT_REASON) or reason.startswith(("smolmachines ", "/dev/kvm ", "the smol ")):
        why = reason.split(" (", 1)[0].split(": ", 1)[0]
    else:
        why = "the engine could not start one"
    if sys.platform.startswith("linux") and pvm_evidence() is not None:
        why += ", on a PVM host"
    return why
