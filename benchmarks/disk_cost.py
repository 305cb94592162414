"""The cost of a namespace guest's btrfs disk (a subvolume with a quota) against a tmpfs disk.

Usage: python benchmarks/disk_cost.py [N]   (root; needs btrfs, mkfs.btrfs and loop devices).
Makes its own state and cache dirs. Prints, for N guests of each kind interleaved (so drift in
host load hits both alike): the median create + first exec + destroy time, the CPU this process
and its helper (zygote, setups, inits: reaped children) spent per guest, and their ratios
btrfs/tmpfs; then the time to write and read back 64 MiB of files in one guest of each kind; and
what the first guest of a helper costs, which makes the helper's btrfs filesystem. The tmpfs arm
is a backend told the host cannot make btrfs disks, the fallback it takes on such a host: the two
differ in that only.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.backends.namespace import disk
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.backends.namespace.guest import NamespaceGuest
from pytest_smolvm.baselines.baseline import Baseline, resolve

KINDS = ("tmpfs", "btrfs")
WRITE = ("for i in 1 2 3 4; do dd if=/dev/zero of=/workspace/f$i bs=1M count=16 2>/dev/null; done; "
         "cat /workspace/f* | wc -c")


def _backend(kind: str) -> NamespaceBackend:
    backend = NamespaceBackend()
    if kind == "tmpfs":  # the cached answer to "can this host make btrfs disks?", as a host that cannot
        backend.__dict__["_disks"] = (disk.images_dir(), "benchmark: the tmpfs arm")
    return backend


def _make(backend: NamespaceBackend, baseline: Baseline, kind: str) -> NamespaceGuest:
    guest = backend.create(VMSpec(name=f"disk-{uuid.uuid4().hex[:10]}", baseline=baseline, memory_mb=2048))
    assert guest.disk == kind, (guest.disk, kind)
    return guest


def _run(guest: NamespaceGuest, command: str) -> str:
    result = guest.exec(["/bin/sh", "-c", command], env={}, workdir=None, stdin=None, timeout=60,
                        output_limit=1 << 20)
    assert result.exit_code == 0, result
    return result.stdout.decode()


def one(backend: NamespaceBackend, baseline: Baseline, kind: str) -> float:
    start = time.perf_counter()
    guest = _make(backend, baseline, kind)
    try:
        _run(guest, "true")
    finally:
        guest.destroy()
    return time.perf_counter() - start


def _cpu(backend: NamespaceBackend) -> float:
    """CPU seconds of this process and of the guests' side: the helper and every setup and init it
    reaped (a guest's teardown runs in its exiting init); the loop device's kernel workers are not in it."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    helper = backend._helper()._proc.pid  # the zygote: a subreaper, it reaps every guest's processes
    fields = Path(f"/proc/{helper}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return own.ru_utime + own.ru_stime + ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    with tempfile.TemporaryDirectory(prefix="smolvm-diskbench-", dir="/var/tmp") as top:
        os.environ["PYTEST_SMOLVM_STATE_DIR"] = os.path.join(top, "state")
        os.environ["PYTEST_SMOLVM_CACHE_DIR"] = os.path.join(top, "cache")
        why = disk.unavailable(os.geteuid() != 0, disk.images_dir())
        if why:
            sys.exit(f"no btrfs guest disks here: {why}")
        backends = {kind: _backend(kind) for kind in KINDS}
        try:
            baseline = resolve(None, Path.cwd())
            backends["tmpfs"].rootfs(baseline)
            first: dict[str, float] = {}
            for kind in KINDS:  # each helper started and both paths warmed once
                first[kind] = one(backends[kind], baseline, kind)
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            cpu: dict[str, float] = dict.fromkeys(KINDS, 0.0)
            for _ in range(n):
                for kind in KINDS:
                    before = _cpu(backends[kind])
                    times[kind].append(one(backends[kind], baseline, kind))
                    cpu[kind] += _cpu(backends[kind]) - before
            writes: dict[str, float] = {}
            for kind in KINDS:
                guest = _make(backends[kind], baseline, kind)
                try:
                    start = time.perf_counter()
                    assert int(_run(guest, WRITE)) == 64 << 20
                    writes[kind] = time.perf_counter() - start
                finally:
                    guest.destroy()
        finally:
            for backend in backends.values():
                backend.close()
    tmpfs, btrfs = (statistics.median(times[kind]) for kind in KINDS)
    print(f"per guest (create + exec true + destroy), median of {n} each, interleaved:")
    print(f"  tmpfs disk: {tmpfs * 1000:.2f} ms   btrfs disk: {btrfs * 1000:.2f} ms   "
          f"ratio btrfs/tmpfs {btrfs / tmpfs:.2f}x ({(btrfs - tmpfs) * 1000:+.2f} ms)")
    print(f"  CPU per guest (this process + the helper and the guests it reaped; 10 ms ticks, summed): "
          f"tmpfs {cpu['tmpfs'] / n * 1000:.2f} ms, btrfs {cpu['btrfs'] / n * 1000:.2f} ms, "
          f"ratio {cpu['btrfs'] / max(cpu['tmpfs'], 1e-9):.2f}x")
    print(f"write + read back 64 MiB of files in a guest: tmpfs {writes['tmpfs'] * 1000:.0f} ms, "
          f"btrfs {writes['btrfs'] * 1000:.0f} ms, ratio {writes['btrfs'] / writes['tmpfs']:.2f}x")
    print(f"a helper's first guest (its start; with btrfs, making its filesystem): "
          f"tmpfs {first['tmpfs'] * 1000:.0f} ms, "
          f"btrfs {first['btrfs'] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
