"""The cost of a namespace guest's ext4 disk (an image on a loop device) against its tmpfs disk.

Usage: python benchmarks/disk_cost.py [N]   (root; needs mkfs.ext4 and loop devices). Makes its
own state and cache dirs. Prints, for N guests of each kind interleaved (so drift in host load
hits both alike): the median create + first exec + destroy time, the CPU this process and its
helper (zygote, setups, inits: reaped children) spent per guest, and their ratios ext4/tmpfs;
then the time to write and read back 64 MiB of files in one guest of each kind; the time to create
10,000 small files, and to create them again after deleting them (a second later: ext4 without a
journal scanned past every recently deleted inode per create); and what making the template costs
once per host per size. Every guest gets an ext4 disk where the host can make one (lent from
the helper's pool: backends/namespace/helper/disk.py), a tmpfs one where it cannot: the two
arms differ in that only.
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

KINDS = ("tmpfs", "ext4")
WRITE = ("for i in 1 2 3 4; do dd if=/dev/zero of=/workspace/f$i bs=1M count=16 2>/dev/null; done; "
         "cat /workspace/f* | wc -c")
SMALL = "mkdir /w; for i in $(seq 100); do mkdir /w/$i; for j in $(seq 100); do echo a > /w/$i/$j; done; done"
# (what is printed, command); the deletion between the two creates is timed but not printed
RECREATE = ("create 10,000 files", SMALL), ("", "rm -rf /w && sleep 1.2"), ("create them again", SMALL)


def _make(backend: NamespaceBackend, baseline: Baseline, kind: str) -> NamespaceGuest:
    # Every guest gets an ext4 disk where the host can make one; the tmpfs arm is what a host
    # that cannot gets (the backend's reason, read once, replaced for the one create).
    images = disk.images_dir()
    backend.__dict__["_disks"] = (images, None if kind == "ext4" else "the tmpfs arm of this benchmark")
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
    reaped (a guest's teardown runs in its exiting init); the loop device's kernel workers are not in it.
    The helper reaps exited inits at the top of its loop and answers a ping once it has cleaned
    the disks given back (helper/diskpool.py): two pings take it round twice, so that the last
    guest's CPU, its disk's clean included, is counted in that guest's arm."""
    for _ in range(2):
        backend._helper().request({"op": "ping"})
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
            sys.exit(f"no ext4 guest disks here: {why}")
        start = time.perf_counter()
        disk.template(2048)
        template_ms = (time.perf_counter() - start) * 1000
        template_kib = os.stat(disk.template(2048)).st_blocks // 2
        backend = NamespaceBackend()
        try:
            baseline = resolve(None, Path.cwd())
            backend.rootfs(baseline)
            for kind in KINDS:
                one(backend, baseline, kind)  # the zygote and both paths warmed once
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            cpu: dict[str, float] = dict.fromkeys(KINDS, 0.0)
            for _ in range(n):
                for kind in KINDS:
                    before = _cpu(backend)
                    times[kind].append(one(backend, baseline, kind))
                    cpu[kind] += _cpu(backend) - before
            writes: dict[str, float] = {}
            small: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for kind in KINDS:
                guest = _make(backend, baseline, kind)
                try:
                    start = time.perf_counter()
                    assert int(_run(guest, WRITE)) == 64 << 20
                    writes[kind] = time.perf_counter() - start
                    for _what, command in RECREATE:
                        start = time.perf_counter()
                        _run(guest, command)
                        small[kind].append(time.perf_counter() - start)
                finally:
                    guest.destroy()
        finally:
            backend.close()
    tmpfs, ext4 = (statistics.median(times[kind]) for kind in KINDS)
    print(f"per guest (create + exec true + destroy), median of {n} each, interleaved:")
    print(f"  tmpfs disk: {tmpfs * 1000:.2f} ms   ext4 disk: {ext4 * 1000:.2f} ms   "
          f"ratio ext4/tmpfs {ext4 / tmpfs:.2f}x (+{(ext4 - tmpfs) * 1000:.2f} ms)")
    print(f"  CPU per guest (this process + the helper and the guests it reaped; 10 ms ticks, summed): "
          f"tmpfs {cpu['tmpfs'] / n * 1000:.2f} ms, ext4 {cpu['ext4'] / n * 1000:.2f} ms, "
          f"ratio {cpu['ext4'] / max(cpu['tmpfs'], 1e-9):.2f}x")
    print(f"write + read back 64 MiB of files in a guest: tmpfs {writes['tmpfs'] * 1000:.0f} ms, "
          f"ext4 {writes['ext4'] * 1000:.0f} ms, ratio {writes['ext4'] / writes['tmpfs']:.2f}x")
    for step, (what, _command) in enumerate(RECREATE):
        if what:
            print(f"{what} in a guest: tmpfs {small['tmpfs'][step] * 1000:.0f} ms, "
                  f"ext4 {small['ext4'][step] * 1000:.0f} ms, ratio {small['ext4'][step] / small['tmpfs'][step]:.2f}x")
    print(f"the 2 GiB template, once per host: mkfs.ext4 {template_ms:.1f} ms, {template_kib} KiB of data")


if __name__ == "__main__":
    main()
