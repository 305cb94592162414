"""The host-wide registry of guests: one JSON record per guest, written before it starts.

A record outlives its owner only when something went wrong (a crash, a failed destroy) or on
purpose (``--smol-keep``). Whoever finds a record whose owner is dead removes the guest and
then the record: the reaper, at session start or end, or ``pytest-smolvm reap`` by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_smolvm.host.paths import runtime_dir, state_dir
from pytest_smolvm.host.procs import is_alive, process_start_time

# Backends whose guests are processes and mounts of this host only: their records live in the
# runtime dir (a tmpfs, gone at reboot with the guests themselves); every other backend's, in
# the state dir (a smol machine, kept or leaked, outlives the host's boot).
HOST_BOUND_BACKENDS = frozenset({"namespace"})


def registry_dir(backend: str | None = None) -> Path:
    return (runtime_dir() if backend in HOST_BOUND_BACKENDS else state_dir()) / "registry"


def registry_dirs() -> list[Path]:
    """Every dir that may hold records: the runtime dir's first (the same dir when both are one)."""
    return list(dict.fromkeys((runtime_dir() / "registry", state_dir() / "registry")))


_OWN_START: dict[str, Any] = {}  # this process's pid and its start time, read once


@dataclass
class Record:
    name: str
    backend: str
    run_id: str
    worker: str
    owner_pid: int
    owner_start: int | None
    test_id: str
    created_at: float = field(default_factory=time.time)
    kept: bool = False
    data: dict[str, Any] = field(default_factory=dict)  # the backend's registry_data()

    @classmethod
    def for_this_process(cls, name: str, backend: str, run_id: str, worker: str, test_id: str) -> Record:
        pid = os.getpid()
        if _OWN_START.get("pid") != pid:  # once per process (a fork is another process)
            _OWN_START.update(pid=pid, start=process_start_time(pid))
        return cls(name, backend, run_id, worker, pid, _OWN_START["start"], test_id)

    @property
    def path(self) -> Path:
        return registry_dir(self.backend) / f"{self.name}.json"

    @property
    def owner_alive(self) -> bool:
        return is_alive(self.owner_pid, self.owner_start)

    def save(self) -> None:
        """Write atomically: a reader sees the old record or the new one, never half of one.

        Three saves per guest (planned, made, taken by its test), so no work a save need not
        do: the dir is made only when missing, and the fields are flat apart from ``data``.
        """
        directory = str(registry_dir(self.backend))
        tmp = os.path.join(directory, f".{self.name}.{os.getpid()}.tmp")  # named so in _nsguest._clean_after_owner too
        payload = json.dumps(vars(self)).encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(directory, f"{self.name}.json"))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a full disk must not leave half a record behind
            raise

    def remove(self) -> None:
        for directory in registry_dirs():  # wherever it was saved: an older version kept all in one
            try:
                (directory / f"{self.name}.json").unlink()
            except FileNotFoundError:
                pass


def load(path: Path) -> Record | None:
    try:
        raw: Mapping[str, Any] = json.loads(path.read_text())
        return Record(**raw)
    except (OSError, ValueError, TypeError):
        return None


def records() -> Iterator[Record]:
    seen: set[str] = set()
    for directory in registry_dirs():
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.json")):
            record = load(path)
            if record is not None and record.name not in seen:
                seen.add(record.name)
                yield record


@dataclass
class ReapReport:
    removed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


def reap(select: Callable[[Record], bool], destroy: Callable[[Record], None]) -> ReapReport:
    """Destroy every recorded guest that ``select`` picks, then forget it.

    A guest whose destroy fails keeps its record, so a later reap can try again.
    """
    report = ReapReport()
    sweep_partial_saves()
    for record in list(records()):
        if not select(record):
            continue
        try:
            destroy(record)
        except Exception as exc:  # one stuck guest must not stop the others' cleanup
            report.failed.append((record.name, f"{type(exc).__name__}: {exc}"))
            continue
        record.remove()
        report.removed.append(record.name)
    return report


def sweep_partial_saves() -> None:
    """Remove the temp files of saves whose writer died in the middle (``.NAME.PID.tmp``).

    A process killed between a save's open and its rename leaves one, and when its helper was
    killed too nobody else knows of it. Only dead writers' files: a live process's save is
    still under way.
    """
    for directory in registry_dirs():
        if not directory.is_dir():
            continue
        for path in directory.glob(".*.tmp"):
            writer = path.name.rsplit(".", 2)[-2]
            if writer.isdigit() and process_start_time(int(writer)) is None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


def orphaned(record: Record, *, include_kept: bool = False) -> bool:
    """A guest whose owner is gone (pid dead, or reused by another process)."""
    return (include_kept or not record.kept) and not record.owner_alive
