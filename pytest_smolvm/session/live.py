"""One guest of a pool as the pool keeps it (session/pool.py), and what the pool reads of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pytest_smolvm.backends.base import EgressAttempt, Guest
from pytest_smolvm.errors import GuestError
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.host import procs, registry
from pytest_smolvm.session import admission


@dataclass
class LiveGuest:
    vm: VM
    record: registry.Record
    guest: Guest  # kept out of the VM's public surface
    provision_seconds: float = 0.0
    destroy_seconds: float = 0.0
    egress: list[EgressAttempt] = field(default_factory=list)  # read just before it went
    admitted: admission.Slot | None = None  # its place among the guests alive on this host
    claimed: bool = False  # handed to its one teardown (destroy, release, keep): see GuestPool._claim

    def leave_admission(self) -> None:
        """Free its place among the guests alive on this host (a second call does nothing)."""
        if self.admitted is not None:
            self.admitted.release()
            self.admitted = None


def branched_from(guests: list[LiveGuest]) -> dict[str, str]:
    """Each guest made by ``vm.branch`` among ``guests``, and the guest it was branched from."""
    return {live.vm.name: live.record.parent for live in guests if live.record.parent}


def note_egress(live: LiveGuest) -> None:
    """Read the guest's egress ledger just before it goes."""
    try:
        live.egress = live.guest.egress()
    except GuestError:
        live.egress = []  # its log says why; a teardown never fails for the ledger


def still_running(guest: Guest) -> bool:
    """Whether a guest made ahead still has its init, and nothing has killed it (one without a
    host pid, a cloud machine, is taken as running: the test's first call would say otherwise).
    An init killed a moment ago can still be there, its SIGKILL pending on a busy host."""
    data = guest.registry_data()
    pid, start = data.get("pid"), data.get("pid_start")
    if not isinstance(pid, int):
        return True
    return procs.is_alive(pid, start if isinstance(start, int) else None) and not procs.is_dying(pid)
