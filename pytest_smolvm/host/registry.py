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
from pytest_smolvm.host.procs import host_facts, is_alive, process_start_time

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
    # Where owner_pid means something (procs.host_facts); None in records of versions before them.
    owner_host: str | None = None
    owner_boot: str | None = None
    owner_pidns: str | None = None
    parent: str | None = None  # the guest this one was branched from (vm.branch), if any

    @classmethod
    def for_this_process(cls, name: str, backend: str, run_id: str, worker: str, test_id: str) -> Record:
        pid = os.getpid()
        if _OWN_START.get("pid") != pid:  # once per process (a fork is another process)
            _OWN_START.update(pid=pid, start=process_start_time(pid))
        host, boot, pidns = host_facts()
        return cls(name, backend, run_id, worker, pid, _OWN_START["start"], test_id,
                   owner_host=host, owner_boot=boot, owner_pidns=pidns)

    @property
    def path(self) -> Path:
        return registry_dir(self.backend) / f"{self.name}.json"

    @property
    def here(self) -> bool | None:
        """Whether this host, boot and pid namespace wrote the record; None when it does not
        say (a record of an older version)."""
        if self.owner_boot is None or self.owner_pidns is None:
            return None
        return (self.owner_host, self.owner_boot, self.owner_pidns) == host_facts()

    @property
    def owner_alive(self) -> bool:
        """Whether the owner may still run: another host's is taken to (its pid means nothing here)."""
        return self.here is False or is_alive(self.owner_pid, self.owner_start)

    def save(self) -> None:
        """Write atomically: a reader sees the old record or the new one, never half of one.

        Three saves per guest (planned, made, taken by its test), so no work a save need not
        do: the dir is made only when missing, and the fields are flat apart from ``data``.
        """
        directory = str(registry_dir(self.backend))
        tmp = os.path.join(directory, f".{self.name}.{_writer(self.backend)}.tmp")
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
    left: list[str] = field(default_factory=list)  # records it could not judge from this host

    def left_line(self) -> str | None:
        """One line on what was left alone, for the terminal summary or the console."""
        if not self.left:
            return None
        shown = ", ".join(self.left[:5]) + (f" and {len(self.left) - 5} more" if len(self.left) > 5 else "")
        return (f"reaper left {len(self.left)} guest record(s) it cannot judge from this host (another host, "
                f"boot or pid namespace wrote them, or an older version without host fields): {shown}; "
                "'pytest-smolvm reap NAME' on the host that made one removes it")


def _branches_first(found: list[Record]) -> list[Record]:
    """Deepest branches first, each before the guest it was branched from (vm.branch): the smol
    engine refuses to delete "the branch source of N live machines"."""
    by_name = {record.name: record for record in found}

    def depth(record: Record) -> int:
        steps = 0
        while record.parent in by_name and steps < len(by_name):  # bounded: a cycle cannot hang it
            record, steps = by_name[record.parent], steps + 1
        return steps

    return sorted(found, key=depth, reverse=True)


def reap(select: Callable[[Record], bool], destroy: Callable[[Record], None]) -> ReapReport:
    """Destroy every recorded guest that ``select`` picks, then forget it.

    A guest whose destroy fails keeps its record, so a later reap can try again.
    """
    report = ReapReport()
    sweep_partial_saves()
    for record in _branches_first(list(records())):
        if not select(record):
            if record.here is not True and not record.kept:
                report.left.append(record.name)
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
    """Remove the temp files of saves whose writer died in the middle (``.NAME.PID[@HOST].tmp``).

    A process killed between a save's open and its rename leaves one, and when its helper was
    killed too nobody else knows of it. Only dead writers' files: a live process's save is
    still under way.
    """
    here = _host_tag()
    for directory in registry_dirs():
        if not directory.is_dir():
            continue
        for path in directory.glob(".*.tmp"):
            pid, _, host = path.name.rsplit(".", 2)[-2].partition("@")
            if host not in ("", here):
                continue  # another host's save (a shared state dir): its pid means nothing here
            if pid.isdigit() and process_start_time(int(pid)) is None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


def _writer(backend: str) -> str:
    """Who a save's temp file is from: the pid, and outside the host's own runtime dir (the
    state dir may be shared between hosts) the host too. The namespace helper names its
    own saves ``.NAME.PID.tmp`` when it cleans up after a dead owner (helper/zygote.py)."""
    return str(os.getpid()) if backend in HOST_BOUND_BACKENDS else f"{os.getpid()}@{_host_tag()}"


def _host_tag() -> str:
    """A short name for this host, boot and pid namespace: where a pid means something."""
    if "tag" not in _OWN_START:
        import hashlib

        _OWN_START["tag"] = hashlib.sha256("\0".join(host_facts()).encode()).hexdigest()[:12]
    tag: str = _OWN_START["tag"]
    return tag


def orphaned(record: Record, *, include_kept: bool = False, include_unknown_host: bool = False) -> bool:
    """A guest whose owner is provably gone: recorded by this host, boot and pid namespace,
    and that pid is dead or reused by another process.

    A record from another host is never this host's to judge, however dead its pid looks
    here (a shared state dir: NFS, a CI volume in several containers). A record without host
    fields (written by an older version) is judged only with ``include_unknown_host``: when a
    person names it to ``pytest-smolvm reap`` on the host that made it.
    """
    if record.kept and not include_kept:
        return False
    here = record.here
    if here is False or (here is None and not include_unknown_host):
        return False
    return not is_alive(record.owner_pid, record.owner_start)
