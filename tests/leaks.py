"""What "the host is as we found it" means, checked after every scenario."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pytest_smolvm.backends.namespace.cgroups import state_tag

CGROUP_ROOT = Path("/sys/fs/cgroup")


def guest_processes(state_dir: Path) -> list[str]:
    """Helpers and guest inits started for ``state_dir`` (its tag is in their argv: no host path is)."""
    marker = state_tag(state_dir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"_nsguest.py" in cmdline and marker in cmdline.split(b"\0"):
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry}: {shown}")
    return found


def guest_cgroups(state_dir: Path) -> list[str]:
    """Cgroups of guests made for ``state_dir`` (their names carry its tag)."""
    if not CGROUP_ROOT.is_dir():
        return []
    pattern = f"smolvm-{state_tag(state_dir)}-*"
    found = []
    for controller in CGROUP_ROOT.iterdir():
        if not controller.is_dir():
            continue
        try:
            found += [str(p) for p in controller.rglob(pattern) if p.is_dir()]
        except OSError:
            continue
    return found


def overlay_mounts() -> list[str]:
    with open("/proc/self/mounts") as f:
        return [line for line in f if "smolvm" in line]


def loop_devices(state_dir: Path) -> list[str]:
    """Loop devices backed by a guest's disk image (made unnamed under ``state_dir``/disks:
    backends/namespace/disk.py); sysfs names the backing file, with " (deleted)" for ours."""
    images = f"{state_dir / 'disks'}/"
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            text = backing.read_text().strip()
        except OSError:
            continue  # detached meanwhile
        if text.startswith(images):
            found.append(f"{backing.parent.parent.name}: {text}")
    return found


def loop_device_bytes(line: str) -> int:
    """The size of the loop device a ``loop_devices`` line names."""
    return int(Path("/sys/block", line.split(":")[0], "size").read_text()) * 512


def leftovers(state_dir: Path) -> dict[str, list[str]]:
    registry = state_dir / "registry"
    scratch = state_dir / "scratch"
    layers = state_dir / "layers"  # branches' copies of their parents' files (vm.branch)
    disks = state_dir / "disks"  # guests' disk images: unnamed while in use, so never a file here
    found = {
        "registry records": sorted(p.name for p in registry.glob("*")) if registry.is_dir() else [],
        "scratch dirs": sorted(p.name for p in scratch.iterdir()) if scratch.is_dir() else [],
        "branch layers": sorted(p.name for p in layers.iterdir()) if layers.is_dir() else [],
        "disk images": sorted(p.name for p in disks.iterdir()) if disks.is_dir() else [],
        "loop devices": loop_devices(state_dir),
        "processes": guest_processes(state_dir),
        "cgroups": guest_cgroups(state_dir),
        "mounts": overlay_mounts(),
    }
    return {k: v for k, v in found.items() if v}


def assert_host_clean(state_dir: Path, timeout: float = 3.0) -> None:
    """Processes of an exited pytest may take a moment to go; nothing else may linger."""
    deadline = time.monotonic() + timeout
    while True:
        found = leftovers(state_dir)
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not found, f"left behind on the host: {found}"
