"""Why no microVM boots here, in words: host facts read without booting, and the engine's errors.

The probe (``probe.py``) decides by booting; this module explains its verdict, for the one-line
reason a pytest run prints and for ``doctor``. Nothing here boots or imports smol.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

# How a probe that timed out words its reason (``probe.boot``), so a plain reason can recognise it.
TIMEOUT_REASON = "boot did not finish within"


@dataclass(frozen=True)
class KvmFacts:
    exists: bool
    mode: int = 0
    owner: str = ""
    group: str = ""
    caller_can_open: bool = False
    per_vm_uid: str = "no"  # "yes", "maybe" (through the group, if the engine passes it on) or "no"


def kvm_facts(path: str = "/dev/kvm") -> KvmFacts:
    try:
        st = os.stat(path)
    except OSError:
        return KvmFacts(False)
    mode = stat.S_IMODE(st.st_mode)
    # A per-VM uid owns nothing, so the owner bits never count for it. smolmachines' own hint
    # for EACCES is "usermod -aG kvm", so it appears to hand the caller's membership of the
    # device's group on to the VMM; that is a "maybe" we cannot check without a boot.
    if mode & 0o006 == 0o006:
        per_vm = "yes"
    elif mode & 0o060 == 0o060 and st.st_gid != 0 and st.st_gid in (os.getgid(), *os.getgroups()):
        per_vm = "maybe"
    else:
        per_vm = "no"
    return KvmFacts(True, mode, user_name(st.st_uid), group_name(st.st_gid),
                    os.access(path, os.R_OK | os.W_OK), per_vm)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


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


def host_causes() -> list[str]:
    """What on this host stops a microVM, read from the host (never from a boot), in a fixed order.

    The engine's own error differs from one boot to the next on one host (a timeout, an EACCES
    on /dev/kvm, a refused OOM score: whichever step it reached first), so a run's summary that
    quoted it said a different thing each run. These facts do not change between runs.
    """
    if not sys.platform.startswith("linux"):
        return []
    causes = []
    if os.geteuid() == 0 and has_capability(CAP_SYS_RESOURCE) is False:
        causes.append("the VMM lacks CAP_SYS_RESOURCE")
    facts = kvm_facts()
    if facts.exists and facts.per_vm_uid == "no" and os.environ.get("SMOLVM_VM_UID_DROP") != "off":
        causes.append("the VMM may not open /dev/kvm")
    return causes


def _engine_cause(reason: str) -> str:
    if is_kvm_access_denied(reason):
        return "the VMM may not open /dev/kvm"
    if is_oom_adjust_denied(reason):
        return "the VMM lacks CAP_SYS_RESOURCE"  # short: it goes in the summary line
    if reason.startswith(TIMEOUT_REASON) or reason.startswith(("smolmachines ", "/dev/kvm ", "the smol ")):
        return reason.split(" (", 1)[0].split(": ", 1)[0]
    return "the engine could not start one"


def plain_reason(reason: str) -> str:
    """Why no microVM boots here, in a few whole words that stay the same from run to run on one
    host: the host's own facts where they explain it, else the engine's reason (the raw text is
    ``doctor``'s)."""
    if sys.platform.startswith("linux") and pvm_evidence() is not None:
        # Decisive on its own: fixing capabilities or /dev/kvm would not make a guest boot here.
        return "this is a PVM host, where no stock guest kernel boots"
    causes = host_causes() or [_engine_cause(reason)]
    return " and ".join([causes[0], *(c.removeprefix("the VMM ") for c in causes[1:])])
