"""The seccomp filter every namespace guest runs under, compiled once per process by libseccomp.

The filter is built with the field's library (libseccomp, through the ``pyseccomp`` ctypes
binding to the system's ``libseccomp.so.2``), never hand-assembled, and exported as BPF: the
guest helper (which imports nothing outside the standard library) only loads those bytes.

It allows what Docker's default profile allows and denies at least what that profile denies
to a container without CAP_SYS_ADMIN, plus what the issue tracker showed guests using against
the host: nested user namespaces (``unshare``, ``clone``/``clone3`` with namespace flags,
``setns``), keyrings, io_uring, userfaultfd, perf, bpf, kexec and modules,
``open_by_handle_at``, raw and packet sockets, netfilter netlink, and every mount call (the
guest's mounts are all made before the filter is loaded). A non-native syscall ABI (i386,
x32) kills the process: libseccomp's default for a foreign architecture.
"""

from __future__ import annotations

import errno
import functools
import tempfile

from pytest_smolvm.errors import ProvisionError

INSTALL = "pip install pyseccomp (it needs the system's libseccomp: apt-get install libseccomp2)"

DENIED = (
    # namespaces and mounts: nothing after setup
    "unshare", "setns", "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen",
    "fsmount", "fsconfig", "fspick", "mount_setattr",
    # kernel keyrings are not namespaced: shared with host root
    "keyctl", "add_key", "request_key",
    # big kernel attack surface with no use in a test guest
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open", "bpf",
    "fanotify_init", "lookup_dcookie", "kcmp", "pidfd_getfd",
    # the host's machine state
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "create_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "syslog", "iopl", "ioperm", "uselib", "ustat", "sysfs", "_sysctl",
    "nfsservctl", "vm86", "vm86old", "get_kernel_syms", "query_module",
    # host inodes by handle (the "shocker" escape)
    "open_by_handle_at", "name_to_handle_at",
    # NUMA policy (Docker denies these without CAP_SYS_NICE)
    "mbind", "set_mempolicy", "move_pages",
)

NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
AF_NETLINK, AF_PACKET = 16, 17
SOCK_TYPE_MASK, SOCK_RAW, SOCK_PACKET = 0xF, 3, 10
NETLINK_NETFILTER = 12


@functools.lru_cache(maxsize=1)
def guest_filter() -> bytes:
    """The filter as BPF; raises a one-line ProvisionError with the install command if libseccomp is missing."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:
        raise ProvisionError(f"the namespace backend confines every guest with a seccomp filter built by "
                             f"libseccomp, which is not available here ({exc}): {INSTALL}") from None
    deny = sc.ERRNO(errno.EPERM)
    filt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        if sc.resolve_syscall(sc.Arch.NATIVE, name) < 0:
            continue  # not a syscall on this architecture
        filt.add_rule(deny, name)
    # clone(2) with any namespace flag (clone3 cannot be inspected: ENOSYS makes libc use clone).
    for flag in NAMESPACE_FLAGS:
        filt.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    filt.add_rule(deny, "socket", sc.Arg(0, sc.EQ, AF_PACKET))
    filt.add_rule(deny, "socket", sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, SOCK_RAW))
    filt.add_rule(deny, "socket", sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, SOCK_PACKET))
    filt.add_rule(deny, "socket", sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.EQ, NETLINK_NETFILTER))
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        return out.read()
