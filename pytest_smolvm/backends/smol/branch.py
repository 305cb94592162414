"""``vm.branch`` on the smol backend: the engine's live branch of a running machine.

The engine branches only a machine started branchable ("was not started as branchable, so it
has no copy-on-write memory to branch from ... cannot be turned on for an already-running
machine"), and a branchable machine cannot be made by ``branch_batch`` nor combined with an
``egress_interceptor`` (the SDK brief, §2). So a test's guest is started branchable only when
its marker asks (``@pytest.mark.smol(branchable=True)``): it is then branched alone, never in a
batched call, and pays the engine's copy-on-write bookkeeping; every other guest stays plain.

A child carries memory and disk (processes included). ``branch_batch(n)`` is the engine's one
transactional ``branch_batch(names=...)`` call (its children cannot be branched again: the
engine's batch makes plain machines); ``branch()`` makes one child, branchable in turn. The
parent cannot be deleted while its branches live ("the branch source of N live machines"): its
guest deletes them first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pytest_smolvm.backends.smol.common import provision_error
from pytest_smolvm.backends.smol.guest import SmolGuest, delete_machine, delete_named
from pytest_smolvm.backends.smol.sdk import engine_bounded
from pytest_smolvm.errors import GuestError

if TYPE_CHECKING:
    from pytest_smolvm.backends.base import Guest, VMSpec


def branch(backend: Any, parent: Guest, specs: Sequence[VMSpec]) -> list[SmolGuest]:
    """``backend`` is the SmolBackend (typed loosely: it imports this module): its children
    are registered there, as its own creates' are, for its close and its release."""
    from smol import SmolError

    assert isinstance(parent, SmolGuest)
    backend._asked = True  # close() then looks for machines whose answer was lost
    target, on_release = backend.target, backend._release

    if not parent.branchable:
        raise GuestError(f"vm.branch: smol guest {parent.name} was not started branchable; mark its test "
                         "@pytest.mark.smol(branchable=True) (the engine cannot turn it on for a running machine)")
    machine = parent._machine
    names = [spec.name for spec in specs]
    try:
        with engine_bounded(target, ready=backend.ready_timeout):  # the branch and its readiness wait
            made = ([machine.branch(names[0], branchable=specs[0].branchable)] if len(specs) == 1
                    else list(machine.branch_batch(names=names)))
        if len(specs) > 1 and sorted(str(getattr(m, "name", "")) for m in made) != sorted(names):
            for extra in made:
                with contextlib.suppress(Exception):
                    delete_machine(extra, str(getattr(extra, "name", "")), target)
            raise GuestError(f"vm.branch_batch of {parent.name}: the engine made other machines than asked")
    except SmolError as exc:
        delete_named(names, target)  # an answer lost on the way back: what exists of them goes
        raise provision_error(f"smol: could not branch {parent.name}", exc) from exc
    by_name = {str(getattr(m, "name", "")): m for m in made}

    def released(child: SmolGuest, kept: bool) -> None:
        with contextlib.suppress(ValueError):
            parent.branches.remove(child)
        on_release(child, kept)

    children = []
    for spec in specs:
        child = SmolGuest(by_name[spec.name], name=spec.name, target=target, source=parent.name, env=spec.env,
                          on_release=released, branchable=spec.branchable)
        children.append(child)
    parent.branches.extend(children)
    with backend._lock:
        for child in children:
            backend._children[child.name] = child
    return children
