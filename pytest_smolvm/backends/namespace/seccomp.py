"""The seccomp filter every namespace guest runs under, compiled once per process by libseccomp.

The filter is built with the field's library (libseccomp, through the ``pyseccomp`` ctypes
binding to the system's ``libseccomp.so.2``), never hand-assembled, and exported as BPF: the
guest helper (which imports nothing outside the standard library) only loads those bytes.

It allows what Docker's default profile allows and denies at least what that profile denies
to a container without CAP_SYS_ADMIN, plus what the issue tracker showed guests using against
the host: nested user namespaces (``unshare``, ``clone``/``clone3`` with namespace flags,
``setns``), keyrings, io_uring and native AIO contexts, userfaultfd, perf, bpf, kexec and modules,
``open_by_handle_at``, raw and packet sockets, netfilter netlink, and every mount call (the
guest's mounts are all made before the filter is loaded). A non-native syscall ABI (i386,
x32) kills the process: libseccomp's default for a foreign architecture.

The audit netlink socket is answered with EINVAL, as Podman's default profile (containers/common)
answers a container without CAP_AUDIT_WRITE: shadow's ``useradd``/``adduser``/``userdel`` and
libaudit read EINVAL as "this kernel has no audit" and go on, where the EPERM of the raw-socket
rule made them abort ("Cannot open audit interface - aborting"). Docker's default profile
allows the socket (every family but AF_VSOCK); refusing it keeps a guest's root (which holds
CAP_AUDIT_WRITE) from writing records into the host's audit log.
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
NETLINK_AUDIT, NETLINK_NETFILTER = 9, 12


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
    # Native AIO contexts come from one host-wide budget (fs.aio-max-nr, 65536 events): a guest
    # took all of it, and every host process using libaio failed with EAGAIN. ENOSYS reads as
    # "no native AIO in this kernel", which libaio's users (databases, qemu) fall back from.
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "io_setup")
    filt.add_rule(deny, "socket", sc.Arg(0, sc.EQ, AF_PACKET))
    # Raw and packet sockets of every family, netlink included, except the audit socket, whose
    # own rule must be the only one that matches it: where two rules match, libseccomp's EPERM
    # won over the EINVAL. (Netlink sockets are SOCK_RAW; libaudit opens its socket that way.)
    for sock_type in (SOCK_RAW, SOCK_PACKET):
        kind = sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, sock_type)
        filt.add_rule(deny, "socket", sc.Arg(0, sc.NE, AF_NETLINK), kind)
        filt.add_rule(deny, "socket", sc.Arg(0, sc.EQ, AF_NETLINK), kind, sc.Arg(2, sc.NE, NETLINK_AUDIT))
    filt.add_rule(deny, "socket", sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.EQ, NETLINK_NETFILTER))
    filt.add_rule(sc.ERRNO(errno.EINVAL), "socket", sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.EQ, NETLINK_AUDIT))
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        return out.read()
