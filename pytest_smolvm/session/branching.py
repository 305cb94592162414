"""Children of a running guest (``vm.branch``, ``branch_batch``, ``reward``): the owner's guests.

A child is an ordinary guest of its parent's owner (the test's fixture or a ``Session``): a
registry record naming its parent is saved before it starts, it holds a ``--smol-max-vms`` slot
and an admission slot as any guest does, the owner destroys it at teardown (children before
their parent: they are appended after it), the pool's close destroys it if the owner could
not, and the reaper finds it by its record. A child can be branched in turn. Its spec is its
parent's resolved one under its own name (``spec.child``): nothing is resolved again here. A
batch is all or none: a failure destroys what was made and releases every record and slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pytest_smolvm.backends.base import VMSpec, branching
from pytest_smolvm.errors import ProvisionError, UsageError
from pytest_smolvm.handle.base import GuestHandle
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.host import registry
from pytest_smolvm.session import admission
from pytest_smolvm.session.live import LiveGuest
from pytest_smolvm.session.spec import child as child_spec

# The pool, typed loosely: it imports this module (no cycle, even for the type checker's imports).
GuestPool = Any
Owner = Callable[[Any], None]  # takes a child (a LiveGuest) into its owner's list of guests


class PoolBrancher:
    """Makes ``parent``'s children in ``pool``, for ``parent``'s owner (see :func:`own`)."""

    def __init__(self, pool: GuestPool, parent: LiveGuest, spec: VMSpec) -> None:
        self.pool, self.parent, self.spec = pool, parent, spec  # spec: the parent's, resolved once
        self.owner: Owner | None = None

    def branch(self, n: int, *, throwaway: bool = False) -> list[GuestHandle]:
        owner = self.owner
        if owner is None and not throwaway:
            raise UsageError(f"vm.branch: guest {self.parent.vm.name} has no owner yet (a guest made ahead "
                             "or for the baseline setup)")
        what = f"vm.branch of {self.parent.vm.name}"
        with self.pool.creating(what) as children:
            children.extend(self._make(n))
        for live in children:
            child = live.vm._brancher  # attached as it was adopted, of its own spec
            assert isinstance(child, PoolBrancher)
            child.owner = owner
            if not throwaway:
                assert owner is not None
                owner(live)
        return [live.vm for live in children]

    def discard(self, child: GuestHandle) -> None:
        live = self.pool.live.get(child.name)
        if live is not None:
            self.pool.destroy(live)  # now, not in the background: the caller asked for it gone

    # ---------------------------------------------------------------- the batch

    def _make(self, n: int) -> list[LiveGuest]:
        pool, parent = self.pool, self.parent
        backend = branching(pool.backend)  # the one-line error on a backend without the capability
        max_vms = pool.settings.max_vms
        if max_vms and n + 1 > max_vms:
            raise UsageError(f"vm.branch_batch({n}): {n} children and their parent need {n + 1} guests, "
                             f"more than --smol-max-vms={max_vms} lets live at once")
        started = time.monotonic()
        admitted: list[admission.Slot] = []
        records: list[registry.Record] = []
        made: list[LiveGuest] = []
        try:
            alive, creating = pool._admission()  # --smol-max-vms is the alive gate's size where given
            for _ in range(n):
                admitted.append(alive.acquire())
            # smol: branch_batch's children cannot be branchable (the engine's one call makes
            # plain ones); a single branch of a branchable parent is branchable in turn.
            specs = [child_spec(self.spec, pool.new_name(), branchable=self.spec.branchable and n == 1)
                     for _ in range(n)]
            reserve = getattr(backend, "reserve", None)
            for spec in specs:  # recorded before it starts, with its parent named
                record = registry.Record.for_this_process(spec.name, pool.plan.backend, pool.run_id, pool.worker,
                                                          parent.record.test_id)
                record.parent = parent.vm.name
                if reserve is not None:
                    record.data = reserve(spec.name)
                record.save()
                records.append(record)
            turn = creating.acquire()
            try:
                guests = backend.branch(parent.guest, specs)  # all or none: the backend's contract
            finally:
                turn.release()
            for record, guest, spec in zip(records, guests, specs, strict=True):
                made.append(self._adopt(record, guest, spec))
        except BaseException as exc:
            for live in made:
                pool.destroy(live)
            for record in records[len(made):]:
                record.remove()
            for admit in admitted:
                admit.release()
            if isinstance(exc, Exception) and not isinstance(exc, (ProvisionError, UsageError)):
                raise ProvisionError(f"vm.branch of {parent.vm.name}: {type(exc).__name__}: {exc}") from exc
            raise
        for live, admit in zip(made, admitted, strict=True):
            live.admitted = admit
        for live in made:
            live.provision_seconds = time.monotonic() - started
        return made

    def _adopt(self, record: registry.Record, guest: Any, spec: VMSpec) -> LiveGuest:
        record.data = guest.registry_data()
        record.save()
        parent = self.parent.vm
        child = VM.for_spec(guest, spec, backend=parent.backend, isolation=parent.isolation)
        live = LiveGuest(child, record, guest)
        attach(self.pool, live, spec)
        self.pool.live[child.name] = live
        return live


def attach(pool: GuestPool, live: LiveGuest, spec: VMSpec) -> None:
    """Let ``live`` (made of the resolved ``spec``) be branched once an owner takes it (:func:`own`)."""
    live.vm._brancher = PoolBrancher(pool, live, spec)


def own(vm: GuestHandle, owner: Owner) -> None:
    """``vm``'s children (and theirs) go to ``owner``, who destroys them with its own guests."""
    brancher = vm._brancher
    if isinstance(brancher, PoolBrancher):
        brancher.owner = owner
