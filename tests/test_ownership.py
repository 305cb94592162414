"""Who may reap a recorded guest: only a process on the host, boot and pid namespace that made it.

A state dir can be shared (an NFS home, a CI volume mounted into several containers): there a
record's pid means nothing, and a pid that looks dead here may be another host's live pytest.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_smolvm.host import registry
from pytest_smolvm.host.procs import host_facts, process_start_time


def _dead_pid() -> tuple[int, int]:
    """A pid that is gone, with the start time it had: a crashed owner, as far as this host sees."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start_time(proc.pid)
    proc.wait()
    assert start is not None
    return proc.pid, start


def _record(name: str, **fields: object) -> Path:
    pid, start = _dead_pid()
    record = registry.Record.for_this_process(name, "namespace", "run", "main", "test_x")
    record = dataclasses.replace(record, owner_pid=pid, owner_start=start, **fields)  # type: ignore[arg-type]
    record.save()
    return record.path


def test_records_name_their_host_boot_and_pid_namespace(smol_state: Path) -> None:
    path = _record("smol-here-1")
    try:
        raw = json.loads(path.read_text())
        assert (raw["owner_host"], raw["owner_boot"], raw["owner_pidns"]) == host_facts()
        assert raw["owner_boot"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    finally:
        path.unlink()


def test_the_reaper_removes_only_what_it_can_prove_dead_on_this_host(smol_state: Path, cli) -> None:  # type: ignore[no-untyped-def]
    mine = _record("smol-mine-1")
    other_boot = _record("smol-otherboot-1", owner_boot="00000000-0000-0000-0000-000000000000")
    other_ns = _record("smol-otherns-1", owner_pidns="1")
    other_host = _record("smol-otherhost-1", owner_host="build-agent-7")
    legacy = _record("smol-legacy-1")
    raw = json.loads(legacy.read_text())
    for key in ("owner_host", "owner_boot", "owner_pidns"):
        del raw[key]  # as a version before these fields wrote it
    legacy.write_text(json.dumps(raw))
    try:
        reaped = cli("reap")
        assert reaped.returncode == 0, reaped.stderr
        assert "removed smol-mine-1" in reaped.stdout
        assert not mine.exists()
        for path in (other_boot, other_ns, other_host, legacy):
            assert path.exists(), f"{path.stem} was reaped from another host's or an unknown record"
        [line] = [line for line in reaped.stdout.splitlines() if line.startswith("reaper left")]
        assert "4 guest record(s)" in line and "smol-otherhost-1" in line and "smol-legacy-1" in line
        listing = cli("ls").stdout
        assert "elsewhere" in listing and "unknown" in listing
        # A person who names an old record on the host that made it may remove it.
        assert "removed smol-legacy-1" in cli("reap", "smol-legacy-1").stdout
        assert not legacy.exists()
    finally:
        for path in (mine, other_boot, other_ns, other_host, legacy):
            path.unlink(missing_ok=True)


def test_a_run_leaves_another_hosts_records_and_says_so(pytester: pytest.Pytester, smol_state: Path) -> None:
    foreign = _record("smol-foreign-1", owner_boot="00000000-0000-0000-0000-000000000000")
    try:
        pytester.makepyfile("def test_one(smol_vm):\n    assert smol_vm.exec('true').exit_code == 0\n")
        result = pytester.runpytest_subprocess()
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["*reaper left 1 guest record(s) it cannot judge from this host*smol-foreign-1*"])
        assert foreign.exists()
    finally:
        foreign.unlink(missing_ok=True)
