"""Finding and removing smol machines by their labels: what a dead run left, kept machines spared.

Labels cannot change after a machine is made, so "kept" is read from the registry, and a
cloud machine is judged only by the host that labelled it (a pid means nothing elsewhere).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_smolvm.backends.smol.common import (
    LABEL,
    SOURCE_PREFIX,
    OwnedMachine,
    _connect,
    _describe,
    _is_gone,
    cloud_token_source,
)
from pytest_smolvm.backends.smol.sdk import remove_fork_lock
from pytest_smolvm.errors import GuestError
from pytest_smolvm.host.procs import host_identity, is_alive, process_start_time

BACKEND = "smol"  # the registry's name for guests of this backend


def kept_machines() -> set[str]:
    """Machines kept with ``--smol-keep`` on this host, and the sources they need, as
    ``list_owned`` names them (cloud: ids). Labels cannot change after create, so the
    registry is where "kept" is written down."""
    from pytest_smolvm.host import registry

    kept: set[str] = set()
    for record in registry.records():
        if record.backend != BACKEND or not record.kept:
            continue
        data = record.data
        kept.add(str(data.get("id") if data.get("target") == "cloud" else data.get("name")))
        if data.get("source"):
            kept.add(str(data["source"]))
    return kept


def owner_alive(labels: Mapping[str, str]) -> bool:
    """Whether the process that labelled a machine still runs (on this host, as far as we can tell).

    (pid, start time) identifies it; a machine labelled without a start time (a boot probe
    from an older version) gets the benefit of the doubt while its pid exists, so a live
    run's probe is never deleted under it.
    """
    try:
        owner = int(labels.get("owner_pid") or 0)
    except ValueError:
        return False
    if owner <= 0:
        return False
    start = labels.get("owner_start") or ""
    if start.isdigit():
        return is_alive(owner, int(start))
    return process_start_time(owner) is not None


def list_owned(labels: Mapping[str, str], target: str = "local") -> list[OwnedMachine]:
    """Machines whose labels include ``labels``, children before sources (the delete order)."""
    from smol import Machine

    summaries = Machine.list(_connect(target), labels=dict(labels))
    owned = [OwnedMachine(s.id if target == "cloud" else s.name, s.state, dict(s.labels),
                          bool(s.branchable) or s.name.startswith(SOURCE_PREFIX)) for s in summaries]
    return sorted(owned, key=lambda m: (m.is_source, m.name))


def destroy_recorded(data: Mapping[str, Any]) -> None:
    """Delete a machine known only by its record; an already-gone machine is not an error."""
    from smol import Machine, SmolError

    target = str(data.get("target") or "local")
    name = str(data.get("id") if target == "cloud" and data.get("id") else data.get("name") or "")
    if not name:
        return
    try:
        Machine.delete_by_name(name, _connect(target))
    except SmolError as exc:
        if not _is_gone(exc):
            raise GuestError(f"could not delete smol machine {name}: {_describe(exc)}") from exc
    if target == "local":
        remove_fork_lock(name)


def reap_unrecorded() -> list[str]:
    """Machines labelled by us whose owner (pid, start time) is gone: children, then sources.

    Local machines always; cloud ones too when a cloud key is configured, but only those
    labelled by this host (a pid says nothing about another host's processes: TTL is
    what removes those).
    """
    from smol import SmolError

    removed: list[str] = []
    failed: list[str] = []
    kept = kept_machines()
    targets = ["local", "cloud"] if cloud_token_source() is not None else ["local"]
    here = host_identity()
    for target in targets:
        try:
            machines = list_owned({LABEL: "1"}, target=target)
        except SmolError as exc:
            failed.append(f"listing {target} machines: {_describe(exc)}")
            continue
        for machine in machines:
            if target == "cloud" and machine.labels.get("owner_host") != here:
                continue
            if owner_alive(machine.labels) or machine.name in kept:
                continue
            try:
                destroy_recorded({"name": machine.name, "id": machine.name, "target": target})
            except GuestError as exc:
                failed.append(str(exc))
                continue
            removed.append(machine.name)
    if failed:
        raise GuestError(f"smol reap removed {len(removed)} machine(s) but: {'; '.join(failed)}")
    return removed
