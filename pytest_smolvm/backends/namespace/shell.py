"""``pytest-smolvm shell`` into a kept namespace guest, confined like any command the guest runs.

A kept guest is the one a hostile guest has been waiting for: the user runs a shell in it by
hand. So the shell is no host process with the guest's files in view (``nsenter`` with every
capability was): it joins the guest's cgroup and every namespace of its init, takes the
guest's root as its own, and then, like the guest's own commands, keeps only the guest's
capability set, runs under the guest's seccomp filter and with ``no_new_privs``. The init's pid
must still carry the start time recorded for it: a reused pid is some other process.

In user-namespace mode the guest's init is not dumpable, so no unprivileged process may join
its namespaces: the shell says so and runs nothing (it never falls back to the host's).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_smolvm.host.procs import process_start_time

PR_SET_NO_NEW_PRIVS = 38
NAMESPACES = (("user", 0x10000000), ("cgroup", 0x02000000), ("ipc", 0x08000000), ("uts", 0x04000000),
              ("net", 0x40000000), ("pid", 0x20000000), ("mnt", 0x00020000))  # user first, mnt last
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def shell(data: Mapping[str, Any], name: str, command: Sequence[str]) -> int:
    """Run ``command`` (default ``/bin/sh``) in the kept guest ``data`` describes; its exit status."""
    pid = int(data.get("pid") or 0)
    if pid <= 1 or process_start_time(pid) != data.get("pid_start"):
        print(f"pytest-smolvm shell: guest {name} is gone (its init is not running)", file=sys.stderr)
        return 2
    from pytest_smolvm.backends.namespace import seccomp

    bpf = seccomp.guest_filter()  # before entering: libseccomp lives on the host
    env = {"PATH": GUEST_PATH, "HOME": "/root", "HOSTNAME": name, "TERM": os.environ.get("TERM", "xterm")}
    child = os.fork()
    if child == 0:
        try:
            _enter(pid, [str(d) for d in data.get("cgroups", [])], bpf)
            grandchild = os.fork()  # the first process of ours inside the guest's pid namespace
            if grandchild == 0:
                _confine(bpf)
                argv = list(command) or ["/bin/sh"]
                os.execvpe(argv[0], argv, env)
            os._exit(os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1]) & 0xFF)
        except BaseException as exc:
            print(f"pytest-smolvm shell: {exc}", file=sys.stderr)
            os._exit(127)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def _enter(pid: int, cgroups: list[str], bpf: bytes) -> None:
    """Join the guest's cgroups and namespaces and take its root (in the forked child)."""
    from pytest_smolvm.backends.namespace.helper import kernel as guest

    guest._check(guest._prctl(guest.PR_SET_DUMPABLE, 0), "prctl(PR_SET_DUMPABLE)")  # no ptrace from the guest
    fds = {}
    for ns, _ in NAMESPACES:  # every one, or none: a shell must never run in the host's instead
        try:
            fds[ns] = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
        except PermissionError:
            raise RuntimeError("cannot enter the guest: its init is not dumpable, so only root may join its "
                               "namespaces (in user-namespace mode, run pytest and the shell as root)") from None
    for directory in cgroups:  # the host's view of cgroupfs: before the mount namespace changes
        with open(os.path.join(directory, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    for ns, flag in NAMESPACES:
        if os.fstat(fds[ns]).st_ino != os.stat(f"/proc/self/ns/{ns}").st_ino:  # root mode shares the user ns
            guest._check(guest._libc.setns(ctypes.c_int(fds[ns]), ctypes.c_int(flag)), f"setns({ns})")
        os.close(fds[ns])
    os.chdir("/")  # joining the mount namespace took its root: the mount on top, the guest's pivoted root


def _confine(bpf: bytes) -> None:
    """What every guest command has: the guest's capabilities and seccomp filter; and no_new_privs."""
    from pytest_smolvm.backends.namespace.helper import kernel as guest

    guest._check(guest._prctl(PR_SET_NO_NEW_PRIVS, 1), "prctl(PR_SET_NO_NEW_PRIVS)")
    guest._load_seccomp(bpf)
    guest._drop_capabilities()
