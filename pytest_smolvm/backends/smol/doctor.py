"""``pytest-smolvm doctor``: can this host boot microVMs, which backend would run, and the fix.

Every check prints one line with a verdict; every problem is followed by what to do about it
in plain words. The probe is re-run uncached, and its answer replaces the one pytest runs use.

Exit codes, for scripts (docs/configuration.md):

- 0: guests run on this host: a microVM boots, or, where none does (no KVM, a PVM host), the
  namespace backend runs them instead, which is the expected outcome on such a host;
- 1: no backend can run a guest here;
- 3: ``--require-microvm`` was given and no microVM boots here (the namespace backend may run).
"""

from __future__ import annotations

import os
import platform
import sys
import textwrap
from dataclasses import dataclass, field
from typing import TextIO

from pytest_smolvm.backends.base import ProbeResult
from pytest_smolvm.backends.selection import select_backend
from pytest_smolvm.backends.smol import boot_failures
from pytest_smolvm.backends.smol import probe as probe_mod
from pytest_smolvm.backends.smol import sdk as smol_sdk
from pytest_smolvm.backends.smol.boot_failures import KvmFacts, kvm_facts, pvm_evidence, user_name

# The VMM drops to a uid from this range before opening /dev/kvm (smolmachines' per-VM uid isolation).
PER_VM_UID_BASE = 2_000_000


EXIT_GUESTS_RUN = 0
EXIT_NO_BACKEND = 1
EXIT_NO_MICROVM = 3
WIDTH = 100
INDENT = " " * 7
VERDICT_INDENT = " " * len("verdict: ")


@dataclass
class Report:
    out: TextIO
    fixes: list[str] = field(default_factory=list)

    def line(self, status: str, what: str, detail: str = "") -> None:
        text = f"[{status:>4}] {what}{': ' + detail if detail else ''}"
        self.out.write(textwrap.fill(text, WIDTH, subsequent_indent=INDENT, break_on_hyphens=False) + "\n")

    def say(self, text: str) -> None:
        self.out.write(textwrap.fill(text, WIDTH, initial_indent=INDENT, subsequent_indent=INDENT,
                                     break_on_hyphens=False) + "\n")

    def fix(self, text: str, *, first: bool = False) -> None:
        """Record a fix for the summary; ``first`` puts it ahead of the others (it must come first)."""
        if text not in self.fixes:
            self.fixes.insert(0, text) if first else self.fixes.append(text)


def _check_platform(report: Report) -> None:
    report.line("info", "host", f"{platform.system()} {platform.release()} {platform.machine()}, "
                                f"Python {platform.python_version()}")


def _check_smolmachines(report: Report) -> bool:
    installed = probe_mod.smolmachines_version()
    if installed is None:
        report.line("FAIL", "smolmachines", "not installed")
        report.fix("pip install smolmachines (the smol backend and the bundled Alpine baseline come with it)")
        return False
    read = smol_sdk.SDK_VERSION_READ
    if installed == read:
        report.line("ok", "smolmachines", f"{installed}, the version pytest-smolvm was checked against")
        return True
    changed = smol_sdk.internals_problems()
    if changed:
        report.line("FAIL", "smolmachines", f"{installed}; pytest-smolvm was checked against {read}, and SDK "
                    f"internals its smol backend uses have changed: {'; '.join(changed)}")
    else:
        report.line("warn", "smolmachines", f"{installed}; pytest-smolvm was checked against {read}: the SDK "
                    "internals its smol backend uses are all there, but what changed in between was not read")
    report.fix(f"pip install 'smolmachines=={read}' to run the SDK version pytest-smolvm was checked against")
    return True


UDEV_0666 = ("to keep mode 0666 across reboots add the udev rule KERNEL==\"kvm\", GROUP=\"kvm\", MODE=\"0666\" to "
             "/etc/udev/rules.d/65-kvm.rules and run sudo udevadm control --reload && sudo udevadm trigger")
UID_DROP_OFF = "Or set SMOLVM_VM_UID_DROP=off so each VMM runs as your uid (weaker isolation between VMs)"


def kvm_access_fix(facts: KvmFacts | None) -> str:
    """What lets the VMM's own uid open /dev/kvm, from the state /dev/kvm is in now: a step the
    host has already taken (a kvm group, mode 0660) is not suggested again."""
    lead = "let the VMM's own uid open /dev/kvm: "
    if facts is None or not facts.exists:
        return (lead + "either give /dev/kvm to a kvm group with mode 0660 and join it (sudo groupadd -f kvm; "
                "sudo usermod -aG kvm $USER; log in again), or make it mode 0666 (sudo chmod 0666 /dev/kvm); "
                f"{UDEV_0666}. {UID_DROP_OFF}")
    state = f"it is {facts.owner}:{facts.group} {facts.mode:04o} now"
    group_rw = facts.group not in ("root", "0") and facts.mode & 0o060 == 0o060
    if group_rw and facts.per_vm_uid == "no":  # the group is there; the caller is not in it
        return (lead + f"{state}, so either join {facts.group} (sudo usermod -aG {facts.group} $USER; log in "
                "again), which smolmachines may pass on to the VMM, or make it mode 0666 (sudo chmod 0666 "
                f"/dev/kvm); {UDEV_0666}. {UID_DROP_OFF}")
    if group_rw:  # joined already: only the other bits are left to try
        return (lead + f"{state} and you are in {facts.group}, which the VMM may not inherit: make it mode "
                f"0666 (sudo chmod 0666 /dev/kvm); {UDEV_0666}. {UID_DROP_OFF}")
    return (lead + f"{state}: either give it to a kvm group with mode 0660 and join it (sudo groupadd -f kvm; "
            "sudo chgrp kvm /dev/kvm; sudo chmod 0660 /dev/kvm; sudo usermod -aG kvm $USER; log in again), or "
            f"make it mode 0666 (sudo chmod 0666 /dev/kvm); {UDEV_0666}. {UID_DROP_OFF}")


def _check_kvm(report: Report) -> KvmFacts | None:
    if sys.platform == "darwin":
        report.line("info", "hypervisor", "macOS: smolmachines uses Hypervisor.framework (Apple Silicon)")
        return None
    facts = kvm_facts()
    if not facts.exists:
        report.line("FAIL", "/dev/kvm", "missing")
        report.fix("enable hardware virtualisation (VT-x/AMD-V) in the firmware and load kvm_intel or "
                   "kvm_amd; inside a cloud VM pick an instance type with nested virtualisation; "
                   "or run on smol cloud with --smol-target=cloud")
        return facts
    can = "can" if facts.caller_can_open else "cannot"
    you = user_name(os.geteuid())
    report.line("ok" if facts.caller_can_open else "FAIL", "/dev/kvm",
                f"{facts.owner}:{facts.group} mode {facts.mode:04o}; you ({you}) {can} open it")
    if not facts.caller_can_open:
        report.fix(f"join the {facts.group} group (sudo usermod -aG {facts.group} $USER) and log in again")
    if os.environ.get("SMOLVM_VM_UID_DROP") == "off":
        report.line("info", "per-VM uid", "off (SMOLVM_VM_UID_DROP=off): each VMM runs as you")
        return facts
    verdict = {"yes": "can", "maybe": "probably can (through the group)", "no": "cannot"}[facts.per_vm_uid]
    report.line("ok" if facts.per_vm_uid == "yes" else "warn", "per-VM uid",
                f"smolmachines' VMM drops to a uid of its own (about {PER_VM_UID_BASE} and up) before "
                f"it opens /dev/kvm; with {facts.owner}:{facts.group} {facts.mode:04o} that uid {verdict} "
                "open it")
    if facts.per_vm_uid == "no":
        report.fix(kvm_access_fix(facts))
    return facts


OOM_ADJUST_FIX = (
    "give pytest CAP_SYS_RESOURCE: run its container with --cap-add=SYS_RESOURCE (Docker, Podman), add "
    "SYS_RESOURCE to the pod's securityContext.capabilities (Kubernetes), or set "
    "AmbientCapabilities=CAP_SYS_RESOURCE (a systemd unit)")


def _check_capabilities(report: Report) -> None:
    """A root that lacks CAP_SYS_RESOURCE is a confined one (a container): the engine needs it."""
    if os.geteuid() != 0 or boot_failures.has_capability(boot_failures.CAP_SYS_RESOURCE) is not False:
        return  # an ordinary user holds no capabilities at all: nothing to read from that
    report.line("warn", "capabilities", "you are root without CAP_SYS_RESOURCE (a container's default set "
                                        "leaves it out); smolmachines' VMM needs it to lower its OOM score")
    report.fix(OOM_ADJUST_FIX)


def _check_pvm(report: Report) -> str | None:
    evidence = pvm_evidence()
    if evidence is None:
        report.line("ok", "KVM flavour", "no sign of PVM")
        return None
    report.line("warn", "KVM flavour", f"this looks like a PVM host: {evidence}")
    report.say("PVM (pagetable-based virtual machines) lets a cloud VM run guests without nested "
               "virtualisation, but only guest kernels built for PVM boot on it. The kernel bundled in "
               "smolmachines is not one, so its guests hang at boot here even once /dev/kvm opens.")
    report.fix("PVM host: run microVMs on a host with real KVM (bare metal, or a cloud VM with nested "
               "virtualisation), or on smol cloud with --smol-target=cloud. Fixing /dev/kvm access alone "
               "will not make guests boot here; the namespace backend runs instead.", first=True)
    return evidence


def _check_boot(report: Report) -> probe_mod.BootReport:
    limit = probe_mod.probe_timeout()
    report.say(f"booting a bare microVM (at most {limit:g}s; set {probe_mod.TIMEOUT_ENV} to change that) ...")
    report.out.flush()
    result = probe_mod.boot(limit)
    if result.available:
        report.line("ok", "microVM boot", result.reason)
    else:
        report.line("FAIL", "microVM boot", f"failed after {result.elapsed:.1f}s: {result.reason}")
    return result


def _explain_boot_failure(report: Report, result: probe_mod.BootReport, kvm: KvmFacts | None,
                          pvm: str | None) -> list[str]:
    """Say why the boot failed; returns the causes in plain words for the verdict."""
    causes = []
    reason = result.reason
    if boot_failures.is_kvm_access_denied(reason):
        report.say("why: the VMM could not open /dev/kvm (EACCES). smolmachines drops each VMM to an "
                   "unprivileged uid of its own, so it does not help that you can open /dev/kvm: that uid "
                   "must be able to.")
        report.fix(kvm_access_fix(kvm))
        causes.append("the microVM monitor, which runs as a uid of its own, may not open /dev/kvm")
    elif boot_failures.is_oom_adjust_denied(reason):
        report.say("why: the engine's monitor sets its oom_score_adj to -500 before it boots a guest, and "
                   "the kernel lets a process lower it only with CAP_SYS_RESOURCE, which this one "
                   "lacks. Docker and Podman leave that capability out of a container's default set, "
                   "root or not.")
        report.fix(OOM_ADJUST_FIX)
        causes.append("the microVM monitor may not lower its OOM score (CAP_SYS_RESOURCE is missing)")
    elif result.timed_out and pvm:
        report.say("why: the guest kernel hangs at boot on this PVM host (see above).")
    elif result.timed_out:
        causes.append(f"the boot did not finish within {probe_mod.probe_timeout():g}s")
        report.say("why: the engine or the guest kernel stalled. On first use the engine also unpacks its "
                   "36 MB guest rootfs, which can take longer than the probe allows.")
        report.fix(f"run the doctor again; if it still stalls, raise {probe_mod.TIMEOUT_ENV} or read "
                   "agent-startup-error.log under ~/.cache/smolvm/vms/")
    elif kvm is not None and not kvm.exists:
        causes.append("this host has no /dev/kvm")
    else:
        causes.append("the engine refused to boot (see the reason)")
        report.fix("see the boot error above; the engine's per-VM logs are under ~/.cache/smolvm/vms/")
    if pvm:
        causes.append("this is a PVM host, where smolmachines' guest kernel cannot boot")
    return causes


def _check_cloud(report: Report) -> None:
    from pytest_smolvm.backends.smol.backend import cloud_token_source

    source = cloud_token_source()
    if source is None:
        report.line("info", "smol cloud", "no API key (SMOL_CLOUD_TOKEN is unset and the smol CLI is not "
                                          "logged in); for --smol-target=cloud set SMOL_CLOUD_TOKEN or run "
                                          "'smol auth login'")
    else:
        report.line("ok", "smol cloud", f"an API key is configured (from {source}); "
                                        "--smol-target=cloud can run")


def _check_selection(report: Report, boot_result: probe_mod.BootReport) -> bool:
    """Say which backend ``auto`` picks; whether any backend can run a guest here."""
    verdict = ProbeResult(boot_result.available, boot_result.reason)
    try:
        selection = select_backend("auto", "local", probe=lambda: verdict)
    except Exception as exc:  # the report must finish whatever select_backend thinks of this host
        report.line("FAIL", "--smol-backend=auto", str(exc))
        return False
    if selection.name == "smol":
        report.line("ok", "--smol-backend=auto", "would use smol: a microVM per test")
        return True
    from pytest_smolvm.backends import backend_class

    usable = backend_class(selection.name).probe()
    if not usable.available:
        report.line("FAIL", f"--smol-backend={selection.name}", f"cannot run here either: {usable.reason}")
        report.fix("run as root, or enable unprivileged user namespaces (sysctl -w "
                   "kernel.unprivileged_userns_clone=1 user.max_user_namespaces=15000), so that the "
                   "namespace backend can run guests")
        return False
    report.line("warn", "--smol-backend=auto",
                f"would use {selection.name}, because no microVM boots here. Namespace guests share "
                "the host kernel: clean state for every test, but no security boundary against "
                "hostile guest code.")
    for line in getattr(backend_class(selection.name), "describe_host", list)():  # limits, mode, disks
        what, _, detail = line.partition(": ")
        report.line("info", f"{selection.name} {what}", detail)
    return True


def check_cache(report: Report) -> int:
    """Every unpacked baseline in this host's cache verified against its manifest, every file
    hashed (a run only makes the cheap check); the number of damaged trees."""
    from pytest_smolvm.baselines import manifest
    from pytest_smolvm.host.paths import cache_dir

    store = cache_dir() / "baselines"
    trees = sorted(p for p in store.glob("*") if (p / "image.json").is_file()) if store.is_dir() else []
    damaged = 0
    for tree in trees:
        problems = manifest.verify(tree)
        if problems:
            damaged += 1
            report.line("FAIL", f"cached baseline {tree.name}", "; ".join(problems[:5]) +
                        (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
            report.fix(f"remove {tree} (the next run unpacks it again)")
    if trees and not damaged:
        report.line("ok", f"{len(trees)} cached baseline{'s' if len(trees) > 1 else ''} verified",
                    "every file as it was unpacked")
    return damaged


def run_doctor(out: TextIO, *, require_microvm: bool = False) -> int:
    """Print the diagnosis to ``out``; the exit code as the module docstring says."""
    report = Report(out)
    out.write("pytest-smolvm doctor\n")
    _check_platform(report)
    has_smol = _check_smolmachines(report)
    kvm = _check_kvm(report)
    if sys.platform.startswith("linux"):
        _check_capabilities(report)
    pvm = _check_pvm(report) if sys.platform.startswith("linux") else None
    if has_smol:
        result = _check_boot(report)
        probe_mod.remember(result)  # the next pytest run need not boot again
    else:
        result = probe_mod.BootReport(False, "smolmachines is not installed", 0.0)
    causes = [] if result.available else _explain_boot_failure(report, result, kvm, pvm)
    _check_cloud(report)
    check_cache(report)
    guests_run = _check_selection(report, result)
    out.write("\n")
    if result.available:
        out.write("verdict: microVMs boot on this host; --smol-backend=auto uses the smol backend.\n")
        return EXIT_GUESTS_RUN
    verdict = ["no microVM boots on this host" + (": " + ", and ".join(causes) if causes else "") + "."]
    if guests_run:
        verdict.append("Tests still get a fresh guest each: the namespace backend runs them (Linux namespaces "
                       "over a copy-on-write copy of the baseline).")
    verdict.append(f"reason: {result.reason}")
    for i, paragraph in enumerate(verdict):  # one block, hanging under "verdict: "
        out.write(textwrap.fill(paragraph, WIDTH, initial_indent="verdict: " if i == 0 else VERDICT_INDENT,
                                subsequent_indent=VERDICT_INDENT, break_on_hyphens=False) + "\n")
    if report.fixes:
        out.write("what to do:\n")
        for i, text in enumerate(report.fixes, 1):
            out.write(textwrap.fill(f"{i}. {text}", WIDTH, initial_indent="  ", subsequent_indent="     ",
                                    break_on_hyphens=False) + "\n")
    if not guests_run:
        return EXIT_NO_BACKEND
    return EXIT_NO_MICROVM if require_microvm else EXIT_GUESTS_RUN


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return run_doctor(sys.stdout, require_microvm="--require-microvm" in args)


if __name__ == "__main__":
    sys.exit(main())
