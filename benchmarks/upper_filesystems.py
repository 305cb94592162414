"""Which filesystem under a guest's overlay upper makes small files cheapest: the kernel's share.

Usage: python benchmarks/upper_filesystems.py [ROUNDS]   (root; loop devices; mkfs.ext4, and
mkfs.xfs / mkfs.btrfs where installed: a filesystem without its mkfs is left out).

GNU tar (one process, no Python) unpacks 10,000 files of 100 B in 100 directories into an overlay
made as a guest's root is (an empty lower, ``volatile``), whose upper is on each filesystem in
turn, then again after ``rm -rf`` of what it made (ext4 without a journal skips every
recently deleted inode per create), then as ``copy_in`` makes a tree for a new directory:
straight into the upper, under a name the overlay never looked up, and moved in through the
overlay (backends/namespace/helper/stage.py ``open_stage``). The filesystems sit on 2 GiB
images on loop devices under /var/tmp, as the guests' disks do; tmpfs is the floor, measured in
the same rounds, interleaved. Prints the median wall and system time per unpack, and each
against tmpfs (``staged`` against tmpfs ``new``: the overlay over a tmpfs the guests had before
their ext4 disks). ``ext4 (guests)`` is the guests' own format and mount
(backends/namespace/disk.py, helper/disk.py).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_smolvm.backends.namespace.disk import MKFS_OPTIONS
from pytest_smolvm.backends.namespace.helper.disk import MOUNT_FLAGS

# label: (mkfs argv or None for a tmpfs, mount type, mount options)
FILESYSTEMS: dict[str, tuple[list[str] | None, str, str]] = {
    "tmpfs": (None, "tmpfs", "size=2g"),
    "ext4 (guests)": (["mkfs.ext4", *MKFS_OPTIONS], "ext4", ",".join(MOUNT_FLAGS)),
    "ext4, no journal": (["mkfs.ext4", *MKFS_OPTIONS, "-O", "^has_journal"], "ext4", ",".join(MOUNT_FLAGS)),
    "xfs": (["mkfs.xfs", "-q", "-f", "-K"], "xfs", "defaults"),
    "btrfs": (["mkfs.btrfs", "-q", "-f"], "btrfs", "defaults"),
}
FILES, PER_DIR, SIZE = 10_000, 100, 100


def _source(top: Path) -> Path:
    tree = top / "tree"
    for i in range(FILES):
        folder = tree / f"d{i // PER_DIR:03d}"
        if i % PER_DIR == 0:
            folder.mkdir(parents=True)
        (folder / f"f{i:05d}").write_bytes(os.urandom(SIZE))
    tarball = top / "tree.tar"
    subprocess.run(["tar", "-C", str(tree), "-cf", str(tarball), "."], check=True)
    shutil.rmtree(tree)
    return tarball


def _unpack(tarball: Path, into: Path) -> tuple[float, float]:
    """Wall and system seconds of one ``tar -x``."""
    started = time.perf_counter()
    proc = subprocess.Popen(["tar", "-xf", str(tarball), "-C", str(into)])
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"tar -x into {into} failed ({status})")
    return time.perf_counter() - started, usage.ru_stime


def _mount(label: str, top: Path, undo: list[list[str]]) -> Path:
    """The overlay over ``label``'s filesystem, mounted under ``top``; ``undo`` gets its teardown."""
    mkfs, kind, options = FILESYSTEMS[label]
    disk = top / "disk"
    disk.mkdir(parents=True)
    if mkfs is None:
        subprocess.run(["mount", "-t", kind, "-o", options, "bench", str(disk)], check=True)
    else:
        image = top / "image"
        with image.open("wb") as out:
            out.truncate(2 << 30)
        subprocess.run([*mkfs, str(image)], check=True, capture_output=True)
        loop = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True,
                              text=True).stdout.strip()
        undo.append(["losetup", "-d", loop])
        subprocess.run(["mount", "-t", kind, "-o", options, loop, str(disk)], check=True)
    undo.append(["umount", str(disk)])
    for name in ("upper", "work"):
        (disk / name).mkdir()
    lower, merged = top / "lower", top / "merged"
    lower.mkdir()
    merged.mkdir()
    subprocess.run(["mount", "-t", "overlay", "bench", "-o", f"lowerdir={lower},upperdir={disk}/upper,"
                    f"workdir={disk}/work,volatile", str(merged)], check=True)
    undo.append(["umount", str(merged)])
    return merged


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    labels = [label for label, (mkfs, _, _) in FILESYSTEMS.items() if mkfs is None or shutil.which(mkfs[0])]
    shm = Path(tempfile.mkdtemp(prefix="smolvm-upperfs-", dir="/dev/shm"))
    disks = Path(tempfile.mkdtemp(prefix="smolvm-upperfs-", dir="/var/tmp"))
    undo: list[list[str]] = []
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        tarball = _source(shm)
        roots = {label: _mount(label, disks / str(n), undo) for n, label in enumerate(labels)}
        for round_ in range(rounds + 1):  # round 0 is the warm-up
            for label, root in roots.items():
                for arm in ("new", "again", "staged"):  # "again": into the place of what was just removed
                    into = root / f"t{round_}"
                    if arm == "staged":  # as copy_in stages a new tree: in the upper, then moved in
                        stage = root.parent / "disk" / "upper" / f".stage{round_}"
                        stage.mkdir()
                        took = _unpack(tarball, stage)
                        os.rename(root / stage.name, into)  # through the overlay
                    else:
                        into.mkdir()
                        took = _unpack(tarball, into)
                    if round_:
                        times.setdefault((label, arm), []).append(took)
                    subprocess.run(["rm", "-rf", str(into)], check=True)
    finally:
        for argv in reversed(undo):
            subprocess.run(argv, check=False)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disks, ignore_errors=True)
    floor = {arm: statistics.median(t[1] for t in times[("tmpfs", arm)]) for arm in ("new", "again")}
    floor["staged"] = floor["new"]  # against the overlay over tmpfs, as the tmpfs guests had it
    print(f"tar -x of {FILES:,} files of {SIZE} B into an overlay, median of {rounds} (system time against tmpfs)")
    for (label, arm), runs in times.items():
        wall, system = statistics.median(t[0] for t in runs), statistics.median(t[1] for t in runs)
        print(f"  {label:18s} {arm:6s} wall {wall * 1e3:8.1f} ms  system {system * 1e3:8.1f} ms  "
              f"{system / floor[arm]:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
