"""Removing guests whose owner is gone, for every backend: the registry first, then each
backend's own leftovers (machines it made outside the registry, such as smol sources).

Who calls it: the process that outlives the others, when the run's plan is made (what dead
runs left), when an xdist worker goes down (what it left) and at session end (anything of this
run); and ``pytest-smolvm reap`` by hand.
"""

from __future__ import annotations

from collections.abc import Mapping

from pytest_smolvm.backends import backend_class
from pytest_smolvm.backends.base import Backend
from pytest_smolvm.host import registry


def destroy_record(record: registry.Record) -> None:
    backend_class(record.backend)().destroy_recorded(record.data)


def reap_orphans(*, include_kept: bool = False, names: Mapping[str, object] | None = None) -> registry.ReapReport:
    """Remove recorded guests whose owner process is provably gone (``names`` narrows it to those
    names, and then a record of an older version, without host fields, counts as this host's:
    a person named it)."""
    def select(record: registry.Record) -> bool:
        if names is not None and record.name not in names:
            return False
        return registry.orphaned(record, include_kept=include_kept, include_unknown_host=names is not None)

    report = registry.reap(select, destroy_record)
    if names is not None:
        report.left = [name for name in report.left if name in names]
    return report


def guests_by_test(run_id: str, worker: str) -> dict[str, list[str]]:
    """The recorded guests of ``worker`` of run ``run_id``, by the test each was made for, oldest first."""
    found = sorted((record for record in registry.records() if record.run_id == run_id and record.worker == worker),
                   key=lambda record: record.created_at)
    tests: dict[str, list[str]] = {}
    for record in found:
        tests.setdefault(record.test_id, []).append(record.name)
    return tests


def reap_dead(backend_cls: type[Backend]) -> registry.ReapReport:
    """Everything dead owners left: registry records, then ``backend_cls``'s unrecorded machines."""
    report = reap_orphans()
    try:
        report.removed += backend_cls.reap_unrecorded()
    except Exception as exc:  # the engine may be unusable here; the registry part still counts
        report.failed.append((backend_cls.name, f"{type(exc).__name__}: {exc}"))
    return report
