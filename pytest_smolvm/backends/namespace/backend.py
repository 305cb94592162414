"""The namespace backend: Linux namespaces + overlayfs, for hosts where no microVM boots.

Each guest is a pid-1 init (see ``helper/``) in fresh mount/pid/net/uts/ipc/user namespaces
(as root, the user namespace maps every uid to itself) whose root is an overlay of the baseline rootfs and a
per-guest upper layer on its own disk (an ext4 image or a tmpfs: ``disk.py``). It shares the
host kernel: weaker isolation than a microVM.
"""

from __future__ import annotations

import functools
import os
import resource
import socket
import sys
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

from pytest_smolvm.backends.base import (
    BackendOptions,
    Guest,
    ProbeResult,
    VMSpec,
)
from pytest_smolvm.backends.namespace import branch as _nsbranch
from pytest_smolvm.backends.namespace import cgroups, seccomp
from pytest_smolvm.backends.namespace import disk as _nsdisk
from pytest_smolvm.backends.namespace import dns as _nsdns
from pytest_smolvm.backends.namespace import network as _nsnet
from pytest_smolvm.backends.namespace.guest import NamespaceGuest, destroy_recorded
from pytest_smolvm.backends.namespace.zygote import Zygote
from pytest_smolvm.baselines.archive import apply_layer
from pytest_smolvm.baselines.baseline import Baseline, Rootfs
from pytest_smolvm.baselines.cache import prepare_derived, unpack
from pytest_smolvm.errors import GuestError, ProvisionError, UsageError
from pytest_smolvm.host.paths import runtime_dir

# A limit a test may name, and the cgroup controller without which no rlimit stands in for it:
# a guest that names one this process has no controller for does not start (create).
UNENFORCEABLE = {"memory_mb": "memory", "cpus": "cpu"}
# What the kernel counts per user and checks against the asking process's own rlimit: a guest's
# uids are the host's (root mode) or map to this user (user-namespace mode), so it shares these
# counts with the host's processes of its uid. Guests get 1/GUEST_SHARE of this process's limit:
# together they can never take more than that, and the host keeps the rest
# (tests/security/test_guest_attacks.py, test_14*).
USER_COUNTED = ("RLIMIT_MSGQUEUE", "RLIMIT_SIGPENDING")
GUEST_SHARE = 4
# As root, a guest's init moves into a user namespace of its own, owned by a uid no host process
# should have (helper/kernel.py _own_user_namespace): the kernel charges what it counts per user
# for the guest's processes to that uid, so they cannot exhaust host root's own counts (inotify
# instances and watches, whose limits are system-wide, not rlimits). One uid per guest name, in
# a range past the usual subordinate-uid ranges and below systemd's reserved top ones.
OWNER_UID_BASE = 0x7F000000
OWNER_UID_SPAN = 0x00F00000


class NamespaceBackend:
    name: ClassVar[str] = "namespace"
    isolation: ClassVar[str] = "namespace"
    idle_guests_are_free: ClassVar[bool] = True  # an idle init: ~2.5 MB, no CPU
    # What one guest costs this host for admission control (session/admission.py): its init and
    # helper, and the files it writes (a tmpfs disk is host memory, an ext4 one page cache). A guest may use up to its
    # memory limit, but few do: the bound is on what the host can hold, not on the worst case.
    guest_host_mb: ClassVar[int] = 64

    def __init__(self, options: BackendOptions | None = None) -> None:
        self.options = options or BackendOptions()
        self._zygote: Zygote | None = None
        self._zygote_lock = threading.Lock()
        self._rootfs: dict[str, Rootfs] = {}
        self.userns = os.geteuid() != 0
        self.limits = cgroups.detect()
        self._user_counted = user_counted_rlimits()  # this process's limits, read once

    @classmethod
    def probe(cls) -> ProbeResult:
        if not sys.platform.startswith("linux"):
            return ProbeResult(False, "the namespace backend needs Linux")
        if os.geteuid() != 0 and not _userns_allowed():
            return ProbeResult(False, "not root and unprivileged user namespaces are disabled "
                                      "(sysctl user.max_user_namespaces / kernel.unprivileged_userns_clone)")
        return ProbeResult(True, "Linux namespaces and overlayfs are available")

    @classmethod
    def describe_host(cls) -> list[str]:
        """Header lines: what this host lets a namespace guest have."""
        mode = "as root (capabilities bounded)" if os.geteuid() == 0 else "in a user namespace (unprivileged)"
        disk = _nsdisk.unavailable(os.geteuid() != 0, _nsdisk.images_dir())
        limits = cgroups.detect()
        refused = [key for key, controller in UNENFORCEABLE.items() if controller not in limits.parents]
        applied = limits.summary + (f"; a test naming {' or '.join(refused)} errors here" if refused else "")
        kind = "an ext4 disk each" if disk is None else "a tmpfs each"
        if "memory" not in limits.parents:
            disks = f"{kind}, bounded by disk_mb; no memory limit here"
        elif disk is None:
            disks = f"{kind}, bounded by disk_mb (memory_mb bounds the processes alone)"
        else:
            disks = f"{kind}, charged to memory_mb as well ({disk})"
        return [f"limits: {applied}", f"guests run {mode}", f"disks: {disks}"]

    @classmethod
    def check_baseline(cls, baseline: Baseline, *, option: str = "--smol-baseline") -> None:
        if baseline.kind == "smolmachine":
            raise UsageError(f"{option}={baseline.reference}: a .smolmachine needs the smol backend; the "
                             "namespace backend takes a rootfs dir, a rootfs tarball (.tar, .tar.gz, "
                             ".tar.zst), a docker-save/OCI archive or a registry image")
        if baseline.kind == "registry" and baseline.path is None:
            raise UsageError(f"{option}={baseline.reference}: a registry image must be pinned and pulled "
                             "first (pytest_smolvm.baselines.oci.pull.resolve_image)")

    def prepare_run(self, baseline: Baseline) -> dict[str, str]:
        self.rootfs(baseline)  # unpacked once per host, here rather than inside the first test
        return {}  # workers find the unpacked baseline by digest in the host-wide cache

    def share_source(self, spec: VMSpec) -> str:
        raise ProvisionError("the namespace backend has no shared machines: every guest is made where it is used")

    def rootfs(self, baseline: Baseline) -> Rootfs:
        if baseline.digest not in self._rootfs:
            self._rootfs[baseline.digest] = unpack(baseline, by=self.options.labels.get("worker", "main"))
        return self._rootfs[baseline.digest]

    def _helper(self) -> Zygote:
        with self._zygote_lock:
            if self._zygote is not None and self._zygote.dead:
                self._zygote.close()  # a retry gets a fresh helper; live guests do not need the old one
                self._zygote = None
            if self._zygote is None:
                self._zygote = Zygote(self._state[1])
            return self._zygote

    @functools.cached_property
    def _state(self) -> tuple[Path, str]:
        """The dir of this backend's records and scratch dirs (the runtime dir: nothing of a
        namespace guest survives a reboot) and its tag, read once per backend: its zygote
        carries the tag, and every create and record would otherwise read the environment again."""
        state = runtime_dir()
        return state, cgroups.state_tag(state)

    @functools.cached_property
    def _disks(self) -> tuple[Path, str | None]:
        """Where guests' disk images go, and why this host cannot make them (None: it can); read once."""
        images = _nsdisk.images_dir()
        return images, _nsdisk.unavailable(self.userns, images)

    def create(self, spec: VMSpec, *, layers: Sequence[Path] = ()) -> NamespaceGuest:
        """A guest of ``spec``; ``layers`` (a branch's copy of its parent's upper) go above the baseline."""
        self._refuse_unenforceable(spec)
        allowed = _nsnet.allowed_networks(spec.allow_hosts) if spec.allow_hosts else None
        networked = bool(spec.network or allowed is not None)
        if networked:
            _nsnet.pasta()  # the install hint, before anything is made
        rootfs = self.rootfs(spec.baseline)
        state, tag = self._state
        scratch = state / "scratch" / spec.name
        scratch.mkdir(parents=True, exist_ok=False)
        relax = set(spec.relax)
        bpf = "" if "seccomp" in relax else seccomp.guest_filter().hex()  # raises the install hint
        images, why_not = self._disks
        disk = _nsdisk.kind(why_not)
        cgroup_dirs: list[str] = []
        try:
            disk_request = _nsdisk.request(spec.disk_mb, images) if disk == "ext4" else None
            # A tmpfs disk's files are charged to the cgroup, an ext4 disk's page cache is reclaimable
            cgroup_dirs = cgroups.create(self.limits, f"{tag}-{spec.name}",
                                         cpus=spec.cpus, memory_mb=spec.memory_mb, defaults="limits" not in relax,
                                         disk_mb=spec.disk_mb if disk == "tmpfs" else 0)
            reply, fds = self._helper().request({
                "op": "create", "name": spec.name, "hostname": spec.name[:64], "scratch": str(scratch),
                "state": str(state), "lower": [*map(str, layers), str(rootfs.path)], "disk_mb": spec.disk_mb,
                "disk": disk_request, "network": spec.network,
                "send_ns": networked, "send_upper": True,  # for vm.branch (branch.py)
                "userns": self.userns, "seccomp": bpf,
                "owner_uid": None if self.userns else OWNER_UID_BASE + zlib.crc32(spec.name.encode()) % OWNER_UID_SPAN,
                "rlimits": self._rlimits(spec, relax), "user_counted_rlimits": self._user_counted,
                "cgroup_procs": [os.path.join(d, "cgroup.procs") for d in cgroup_dirs]})
            if "error" in reply:
                killed = cgroups.oom_kills(cgroup_dirs)  # its setup runs in the guest's cgroup
                raise ProvisionError(f"namespace guest {spec.name}: {reply['error']}" + (
                    f" (killed for memory while it was set up: memory_mb={spec.memory_mb} is too small)"
                    if killed else ""))
        except BaseException:
            for path in cgroup_dirs:
                cgroups.remove(path)
            scratch.rmdir()
            raise
        ctl = socket.socket(fileno=fds[0])
        guest = NamespaceGuest(spec.name, ctl, int(reply["pid"]), scratch, cgroup_dirs, rootfs, spec.env,
                               cpus=cgroups.cpus_allowed(self.limits, spec.cpus, defaults="limits" not in relax))
        guest.disk = disk
        if networked:
            try:
                guest.namespaces = _nsnet.receive_namespaces(ctl, spec.name)
                dns_fd = guest.namespaces.pop("dns", -1)
                if dns_fd >= 0:  # network=True: every name, asked of the host's resolver; allow_hosts: its own
                    guest.dns = _nsdns.serve(dns_fd, _nsdns.host_resolver() if allowed is None else None,
                                             allowed[1] if allowed is not None else None)
                guest.nat = _nsnet.start_nat(guest.pid, scratch, guest.namespaces,
                                             allowed[0] if allowed is not None else None)
                try:
                    guest.write_file("/etc/resolv.conf", _nsdns.RESOLV_CONF.encode(), 0o644, user="root")
                except GuestError as exc:
                    raise ProvisionError(f"namespace guest {spec.name}: cannot point its /etc/resolv.conf "
                                         f"at its DNS proxy: {exc}") from None
            except BaseException:
                guest.destroy()
                raise
        try:
            guest.upper_fd = _nsbranch.receive_upper(ctl, spec.name)
        except BaseException:
            guest.destroy()
            raise
        return guest

    def _refuse_unenforceable(self, spec: VMSpec) -> None:
        """A limit the test named that this process has no cgroup controller for (a normal user
        without delegation): no rlimit stands in for memory or a CPU quota, so such a guest does
        not start rather than run unbounded. A default limit that cannot apply is let go (the
        run's header says "limits: not applied")."""
        unenforced = {key: (getattr(spec, key), controller) for key, controller in UNENFORCEABLE.items()
                      if getattr(spec, key) is not None and key not in spec.defaulted
                      and controller not in self.limits.parents}
        if not unenforced:
            return
        asked = " and ".join(f"{key}={value if isinstance(value, int) else format(value, 'g')}"
                             for key, (value, _) in unenforced.items())
        controllers = "/".join(controller for _, controller in unenforced.values())
        why = self.limits.reason or f"the {controllers} controller is not among the cgroups this process may use"
        raise ProvisionError(f"namespace guest {spec.name}: {asked} cannot be enforced for this guest: no "
                             f"{controllers} cgroup here ({why}); run as root, give this process a delegated "
                             f"cgroup v2 with the {controllers} controller, or leave {' and '.join(unenforced)} unset")

    def branch(self, parent: Guest, specs: Sequence[VMSpec]) -> list[Guest]:
        """Children with ``parent``'s files as they are now (see branch.py); all or none."""
        assert isinstance(parent, NamespaceGuest)
        return _nsbranch.branch(lambda spec, layers: self.create(spec, layers=layers), parent, specs,
                                self._state[0])

    def reserve(self, name: str) -> dict[str, Any]:
        """What ``create`` makes on the host for ``name``, saved in its record before it exists.

        The helper hears of it first, so that if this process dies before ``create`` returns
        (a guest made ahead is often half made when a test kills its pytest), the helper
        removes what was made and the record, as it does for the guests it made. If both die,
        the record still gives the reaper everything it needs; no pid yet: nothing to kill.
        """
        state, tag = self._state
        data = {"scratch": str(state / "scratch" / name), "cgroups": cgroups.planned(self.limits, f"{tag}-{name}")}
        self._helper().tell({"op": "expect", "name": name, "state": str(state), **data})
        return data

    def _rlimits(self, spec: VMSpec, relax: set[str]) -> dict[str, int]:
        """Per-guest rlimits where no cgroup controller does the job (user-namespace mode)."""
        if "limits" in relax:
            return {}
        found: dict[str, int] = {}
        if "pids" not in self.limits.parents:
            found["RLIMIT_NPROC"] = cgroups.DEFAULT_PIDS_MAX
        if "memory" not in self.limits.parents:
            found["RLIMIT_FSIZE"] = spec.disk_mb << 20
        return found

    def derive_baseline(self, baseline: Baseline, key: str, populate: Callable[[Guest], None],
                        scratch_guest: Callable[[Baseline], AbstractContextManager[Guest]]) -> Baseline:
        """Run ``populate`` in a guest, once per host per ``key``, and keep its root as a rootfs."""
        rootfs = self.rootfs(baseline)

        def capture(staging: Path) -> None:
            with scratch_guest(baseline) as guest:
                populate(guest)
                assert isinstance(guest, NamespaceGuest)
                guest.export_root(lambda stream: apply_layer(stream, staging, squash_owner=False,
                                                             what="warm baseline export", guest_export=True))

        warm = prepare_derived(key, baseline, rootfs, capture, by=self.options.labels.get("worker", "main"))
        derived = Baseline(f"{baseline.reference} + setup", "rootfs-dir", warm.path, f"sha256:{key}")
        self._rootfs[derived.digest] = warm
        return derived

    def destroy_recorded(self, data: Mapping[str, Any]) -> None:
        destroy_recorded(data)

    @classmethod
    def reap_unrecorded(cls) -> list[str]:
        return []  # every namespace guest is in the registry; baselines are a cache, not guests

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None


def _userns_allowed() -> bool:
    try:
        if Path("/proc/sys/kernel/unprivileged_userns_clone").read_text().strip() == "0":
            return False
        return int(Path("/proc/sys/user/max_user_namespaces").read_text()) > 0
    except (OSError, ValueError):
        return True


def user_counted_rlimits() -> dict[str, int]:
    """A guest's share of the counts the kernel keeps per user (``USER_COUNTED``); a limit this
    process does not have is not one a guest could take from it."""
    found: dict[str, int] = {}
    for name in USER_COUNTED:
        own = resource.getrlimit(getattr(resource, name))[0]
        if own != resource.RLIM_INFINITY:
            found[name] = own // GUEST_SHARE
    return found
