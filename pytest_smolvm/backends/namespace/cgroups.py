"""Per-guest cpu, memory and pids limits through cgroups (v1 or v2), where the host allows it."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import time
from dataclasses import dataclass, field

from pytest_smolvm import limits as guest_defaults  # 'limits' here means a cgroup's

DEFAULT_PIDS_MAX = 4096  # a guest's fork bomb stops here instead of at the host's limit
CPU_PERIOD_US = 100_000
GUEST_PREFIX = "smolvm-"  # every guest cgroup is named so


def cpus_allowed(limits: Limits, cpus: float | None, *, defaults: bool = True) -> float:
    """The CPUs a guest made by :func:`create` with these arguments can use at once."""
    host = float(os.cpu_count() or 1)
    if defaults:
        cpus = cpus or guest_defaults.LIMITS.cpus
    return min(host, cpus) if cpus and "cpu" in limits.parents else host


@dataclass(frozen=True)
class Limits:
    version: str  # "v1", "v2" or "none"
    parents: dict[str, str] = field(default_factory=dict)  # controller -> our cgroup dir
    reason: str = ""

    @property
    def summary(self) -> str:
        if not self.parents:
            return f"not applied ({self.reason})"
        return f"cgroup {self.version}: {', '.join(sorted(self.parents))}"


def _own_cgroups() -> dict[str, str]:
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _mounts() -> list[tuple[str, str, set[str]]]:
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[2] in ("cgroup", "cgroup2"):
                found.append((parts[2], parts[1], set(parts[3].split(","))))
    return found


def detect() -> Limits:
    try:
        own = _own_cgroups()
        mounts = _mounts()
    except OSError as exc:
        return Limits("none", reason=f"cannot read cgroups: {exc.strerror}")
    wanted = ("cpu", "memory", "pids")
    v1 = {c: os.path.join(mnt, own[c].lstrip("/")) for kind, mnt, opts in mounts if kind == "cgroup"
          for c in wanted if c in opts and c in own}
    if v1:
        writable = {c: d for c, d in v1.items() if os.access(d, os.W_OK)}
        if writable:
            return Limits("v1", writable)
        return Limits("v1", reason="the cgroup v1 hierarchy is not writable by this user")
    for kind, mnt, _ in mounts:
        if kind != "cgroup2" or "" not in own:
            continue
        parent = os.path.join(mnt, own[""].lstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = set(f.read().split())
        except OSError:
            continue
        usable = {c: parent for c in wanted if c in enabled}
        if usable and os.access(parent, os.W_OK):
            return Limits("v2", usable)
        return Limits("v2", reason="cpu/memory/pids are not delegated to this process's cgroup")
    return Limits("none", reason="no cgroup hierarchy with cpu, memory or pids controllers")


def state_tag(state: os.PathLike[str] | str) -> str:
    """A short tag of the state dir in every guest cgroup's name: whose guest a cgroup is."""
    return hashlib.sha256(os.fsencode(state)).hexdigest()[:8]


def _write(path: str, value: str) -> None:
    # os.open/os.write, not open(): a file object costs an fstat, an ioctl and two lseeks more
    # per file, four files per guest. A short write to a cgroup file is an error, not a retry.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def planned(limits: Limits, name: str) -> list[str]:
    """The dirs :func:`create` makes for ``name``: known before they exist, so a record can name them."""
    if limits.version == "v2" and limits.parents:
        return [os.path.join(sorted(set(limits.parents.values()))[0], f"{GUEST_PREFIX}{name}")]
    return sorted({os.path.join(parent, f"{GUEST_PREFIX}{name}") for parent in limits.parents.values()})


def create(limits: Limits, name: str, *, cpus: float | None, memory_mb: int | None,
           defaults: bool = True, disk_mb: int = 0) -> list[str]:
    """Make the guest's cgroup(s) with its limits; returns the dirs to join and later remove.

    With ``defaults`` a limit the marker left unset gets its default; without, only what the
    marker asked for (and the pids limit, which keeps a fork bomb off the host) applies.
    ``memory_mb`` is what the guest's processes get, as a microVM's RAM is: the guest's files
    live in its tmpfs disk, charged to this cgroup too, so ``disk_mb`` is added to the limit
    (else a guest filling its disk would be killed for memory instead of told ENOSPC).

    The guest's TCP buffers count too. cgroup v2 charges socket memory to ``memory.max`` by
    default; v1 charges it nowhere until ``memory.kmem.tcp.limit_in_bytes`` is set (a 64 MiB
    guest queued 512 MiB of host kernel memory on loopback sockets), so v1 gets that limit at
    the processes' ``memory_mb``: past it the guest's sockets are under memory pressure (sends
    wait), not the host's.
    """
    if defaults:
        cpus = cpus or guest_defaults.LIMITS.cpus
        memory_mb = memory_mb or guest_defaults.LIMITS.memory_mb
    sockets_mb = memory_mb
    if memory_mb:
        memory_mb += disk_mb
    made: list[str] = []
    dirs = sorted(set(limits.parents.values())) if limits.version == "v2" else None
    try:
        if limits.version == "v2" and dirs:
            path = os.path.join(dirs[0], f"{GUEST_PREFIX}{name}")
            os.mkdir(path)
            made.append(path)
            if "pids" in limits.parents:
                _write(os.path.join(path, "pids.max"), str(DEFAULT_PIDS_MAX))
            if memory_mb and "memory" in limits.parents:
                _write(os.path.join(path, "memory.max"), str(memory_mb << 20))
            if cpus and "cpu" in limits.parents:
                _write(os.path.join(path, "cpu.max"), f"{int(cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
            return made
        for controller, parent in sorted(limits.parents.items()):
            path = os.path.join(parent, f"{GUEST_PREFIX}{name}")
            if path in made:
                continue
            os.mkdir(path)
            made.append(path)
            if controller == "pids":
                _write(os.path.join(path, "pids.max"), str(DEFAULT_PIDS_MAX))
            elif controller == "memory" and memory_mb:
                _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_mb << 20))
                if sockets_mb:
                    with contextlib.suppress(FileNotFoundError):  # a kernel built without it charges nothing
                        _write(os.path.join(path, "memory.kmem.tcp.limit_in_bytes"), str(sockets_mb << 20))
            elif controller == "cpu" and cpus:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(int(cpus * CPU_PERIOD_US)))
        return made
    except OSError:
        for path in made:
            remove(path)
        raise


def kill_members(path: str) -> None:
    """SIGKILL every process in the cgroup at ``path`` (a guest's own; missing is fine).

    Only a guest's cgroup: a record naming any other (damaged, hand-edited) must not kill a
    host cgroup's processes, so a path not named as :func:`create` names them is left alone.
    """
    if not os.path.basename(path.rstrip("/")).startswith(GUEST_PREFIX):
        return
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            pids = [int(line) for line in f if line.strip()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove(path: str, timeout: float = 2.0) -> None:
    """rmdir a guest cgroup; the kernel may need a moment after its last process exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def oom_kills(cgroup_dirs: list[str]) -> int:
    """How many processes the kernel killed for memory in this guest's cgroup so far (0 if unknown)."""
    for path in cgroup_dirs:
        for name, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
            try:
                with open(os.path.join(path, name)) as f:
                    for line in f:
                        field_name, _, value = line.partition(" ")
                        if field_name == key:
                            return int(value)
            except (OSError, ValueError):
                continue
    return 0
