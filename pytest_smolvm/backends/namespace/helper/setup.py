"""A new guest's setup process: namespaces, its root by fd, its confinement, then its init.

Part of the namespace backend's helper (see ``__init__``): standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import socket
import stat
import struct
import traceback
from typing import Any

from pytest_smolvm.backends.namespace.helper.disk import LAYERS, mount_disk
from pytest_smolvm.backends.namespace.helper.init import Init
from pytest_smolvm.backends.namespace.helper.kernel import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    DEVICES,
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    PR_SET_DUMPABLE,
    SYS_PIVOT_ROOT,
    _check,
    _close_all_but,
    _drop_capabilities,
    _libc,
    _load_seccomp,
    _mount,
    _own_user_namespace,
    _prctl,
    _set_rlimits,
    _unshare,
    _write_id_map,
    _write_small,
)

DNS_ADDRESS = "127.0.0.53"  # the guest's resolver: its DNS proxy (backends/namespace/dns.py GUEST_ADDRESS)
SIOCSIFFLAGS = 0x8914  # linux/sockios.h
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40  # linux/if.h


def _mount_root(req: dict[str, Any]) -> str:
    """Scratch disk (an ext4 disk or a tmpfs: backends/namespace/disk.py), overlay root and a
    minimal /dev, all in the guest's private mount ns. Returns the root; its upper layer is
    the ``upper`` beside it."""
    scratch = req["scratch"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    if req.get("disk_fd") is not None:  # an ext4 disk the zygote lends this guest (helper/disk.py)
        base = mount_disk(req["disk_fd"], scratch)
        # The overlay's unmount at the guest's end would sync the whole ext4 (a journal commit,
        # on the guest's exit path); its files die with it, or are cleaned away.
        volatile = ",volatile"
    else:
        _mount("smolvm-scratch", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={req['disk_mb']}m,mode=0755")
        base, volatile = scratch, ""
        for d in LAYERS:
            os.mkdir(os.path.join(base, d))
    root = os.path.join(base, "root")
    # The guest reads its root's mount options in /proc/self/mountinfo: name the layers by
    # fd and relative to their dir, never by their host paths.
    lower_fds = [os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for path in req["lower"]]
    os.chdir(base)
    try:
        lower = ":".join(f"/proc/self/fd/{fd}" for fd in lower_fds)
        options = f"lowerdir={lower},upperdir=upper,workdir=work{volatile}"
        if req["userns"]:
            options += ",userxattr"
        _mount("smolvm-root", "root", "overlay", 0, options)
    finally:
        os.chdir("/")
        for fd in lower_fds:
            os.close(fd)

    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    tops: dict[str, int] = {}
    try:
        for name in ("dev", "proc", "tmp", "workspace"):  # /workspace: as on every smol machine
            tops[name] = _guest_dir(root_fd, name)
        # Mounted through the fd: mount(2) would follow a link in a path; the fd is the directory.
        _mount("smolvm-dev", f"/proc/self/fd/{tops['dev']}", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=1m")
        os.fchmod(tops["tmp"], 0o1777)  # as a smol machine's tmpfs /tmp: every guest user may write
    finally:
        for fd in (root_fd, *tops.values()):
            os.close(fd)
    dev = os.path.join(root, "dev")  # a real directory now, with our tmpfs on it: nothing of the guest's
    for node in DEVICES:
        target = os.path.join(dev, node)
        host = os.stat(f"/dev/{node}")
        if req["userns"]:
            # No CAP_MKNOD here: bind the host's node. The guest's root is not the host's, so
            # it cannot chmod, chown or touch that host inode through the bind.
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))  # a bind-mount target
            _mount(f"/dev/{node}", target, None, MS_BIND, None)
        else:
            # The guest's own inode, as runc makes it: through a bind of the host's node the
            # guest's root could chmod or chown the host's /dev/null. Also cheaper than a mount.
            os.mknod(target, stat.S_IMODE(host.st_mode) | stat.S_IFCHR, host.st_rdev)
            # mknod's mode went through the umask: a non-root guest user could not write /dev/null
            os.chmod(target, stat.S_IMODE(host.st_mode))  # our fresh tmpfs; the guest is not running yet
    for name, dest in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
                       ("ptmx", "pts/ptmx")):
        os.symlink(dest, os.path.join(dev, name))
    for sub in ("pts", "shm"):
        os.mkdir(os.path.join(dev, sub))
    _mount("smolvm-shm", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")
    return root


def _guest_dir(root_fd: int, name: str) -> int:
    """The guest root's top-level directory ``name`` (/dev, /proc, /tmp, /workspace), as an fd.

    The merged root is the guest's own tree: a warm baseline is what an earlier guest left, so
    any entry may be a symlink to anywhere, and before pivot_root the host would resolve it
    among its own paths (a /tmp link to /etc once made the host chmod /etc 1777). So nothing
    here follows a link: one component, O_NOFOLLOW, from the root's fd. A link or file where
    the directory must be is removed from this guest's overlay (the baseline is untouched)
    and the directory made anew.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=root_fd)
    try:
        return os.open(name, flags, dir_fd=root_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    os.unlink(name, dir_fd=root_fd)
    os.mkdir(name, 0o755, dir_fd=root_fd)
    return os.open(name, flags, dir_fd=root_fd)


def _loopback_up() -> None:
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, ifreq))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _enter_root(root: str, req: dict[str, Any]) -> None:
    """Runs as the guest's pid 1: its own /proc, hostname, loopback, then pivot into root."""
    proc = os.path.join(root, "proc")
    _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    # Host-wide knobs stay readable but not writable from the guest; what tells about the host
    # (its keys, kernel memory, timers) reads as empty: Docker's masked and read-only paths.
    for sub in ("keys", "kcore", "timer_list", "sched_debug", "latency_stats", "timer_stats"):
        path = os.path.join(proc, sub)
        if os.path.exists(path):
            try:
                _mount(os.path.join(root, "dev", "null"), path, None, MS_BIND, None)  # the guest's own
            except OSError:
                if not req["userns"]:
                    raise
    for sub in ("acpi", "scsi", "asound"):
        path = os.path.join(proc, sub)
        if os.path.isdir(path):
            try:
                _mount("smolvm-masked", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0")
            except OSError:
                if not req["userns"]:
                    raise
    for sub in ("sys", "sysrq-trigger", "irq", "bus", "fs"):
        path = os.path.join(proc, sub)
        if os.path.exists(path):
            try:
                _mount(path, path, None, MS_BIND, None)
                _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
            except OSError:
                if not req["userns"]:
                    raise
    socket.sethostname(req["hostname"])
    _loopback_up()
    os.chdir(root)
    _check(_libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")


def _join_cgroups(procs_files: list[str]) -> None:
    # "0" is the writer itself, whatever pid namespace it is in.
    for path in procs_files:
        _write_small(path, b"0")


def _send_namespaces(ctl: socket.socket, *, userns: bool) -> None:
    """Hand the host this guest's network namespace (and user namespace) for its NAT: once the
    guest is made nothing of it is dumpable, and in user-namespace mode the host could not open
    them through /proc. The first message on the control socket, the only one the init sends.

    With them goes the guest's DNS proxy socket: UDP 127.0.0.53:53 in the guest's namespace,
    bound here, before any guest code runs, so no guest process can take the address; the
    host serves it (backends/namespace/dns.py). The loopback goes up first: a socket bound to
    an address that was not yet local answers from 127.0.0.1, and resolvers drop such replies."""
    names = ["net", "user"] if userns else ["net"]
    fds = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in names]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as dns:
            fcntl.ioctl(dns, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))
            dns.bind((DNS_ADDRESS, 53))
            fds.append(dns.detach())
        names.append("dns")
        socket.send_fds(ctl, [json.dumps({"namespaces": names}).encode()], fds)
    finally:
        for fd in fds:
            os.close(fd)


def _setup_guest(req: dict[str, Any], ctl: socket.socket, report_w: int) -> None:
    """Runs in the zygote's child; never returns. The child becomes the guest's init.

    As root the zygote made the pid namespace before forking: this process is already the
    guest's pid 1, and one fork per guest is all it takes. In a user namespace the pid
    namespace can only come after the user namespace, so this process makes both and forks
    the init (two forks; the first process reports the init's pid and exits).
    """
    try:
        keep = {ctl.fileno(), report_w}
        if req.get("disk_fd") is not None:
            keep.add(req["disk_fd"])  # the zygote's other disks, lent to other guests, are closed here
        if req.get("mapped_fd") is not None:
            keep.add(req["mapped_fd"])
        devnull = os.open("/dev/null", os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(devnull, target)
        _close_all_but(keep)
        _join_cgroups(req["cgroup_procs"])
        # The cgroup namespace starts at the guest's own cgroup (joined just above): the guest
        # sees "/" in /proc/self/cgroup and can never name, let alone kill, a host cgroup.
        # Always a network namespace of its own: network=True gets user-mode NAT into it from
        # the host side (backends/_nsnet.py), never the host's namespace.
        flags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP | CLONE_NEWNET
        uid, gid = os.getuid(), os.getgid()
        if req["userns"]:
            flags |= CLONE_NEWUSER | CLONE_NEWPID
        # Before the user namespace: what its uids may count at our user's level is capped by
        # these limits as they are when it is made (the kernel's rlimit_max), not by ours.
        _set_rlimits(req, "user_counted_rlimits")
        _unshare(flags)
        if req["userns"]:
            _write_id_map(uid, gid)  # before the next line: it makes /proc/self/* root's
        else:
            # Its network namespace stays the host's user namespace's (the host sets up its
            # NAT), where the guest's root has no capability once it is in a user namespace of
            # its own (_own_user_namespace): ports below 1024 are open to its users, as in
            # rootless Docker and Podman.
            _write_small("/proc/sys/net/ipv4/ip_unprivileged_port_start", b"0")
        if req.get("send_ns"):
            _send_namespaces(ctl, userns=bool(req["userns"]))
        # Not dumpable: no guest process may ptrace this process or the init, read their memory
        # or /proc/PID/environ, or take their sockets with pidfd_getfd. Inherited by every fork
        # (the init, per-request children); execve of a guest command resets it.
        _check(_prctl(PR_SET_DUMPABLE, 0), "prctl(PR_SET_DUMPABLE)")
        root = _mount_root(req)
        # Opened while the path still names the disk just mounted (after the pivot nothing
        # does): for the host, for vm.branch, and for the init, for copy_in's stage (stage.py).
        upper_fd = os.open(os.path.join(os.path.dirname(root), "upper"),
                           os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        if req.get("send_upper"):
            _send_upper(ctl, upper_fd)
        if not req["userns"]:
            _become_init(root, req, ctl, report_w, upper_fd)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(report_w)
            _become_init(root, req, ctl, ready_w, upper_fd)
        os.close(ready_w)
        status = os.read(ready_r, 4096).decode(errors="replace")
        reply = json.loads(status) if status.startswith("{") else {"error": status or "guest init exited during setup"}
        if "error" not in reply:
            reply["pid"] = pid  # as the zygote sees it: this process is not in the guest's pid namespace
        os.write(report_w, json.dumps(reply).encode())
        os._exit(0)
    except BaseException as exc:
        detail = str(exc) if isinstance(exc, (OSError, RuntimeError)) else traceback.format_exc()
        os.write(report_w, json.dumps({"error": detail}).encode())
        os._exit(1)


def _send_upper(ctl: socket.socket, upper_fd: int) -> None:
    """Hand the host the guest's upper layer as a directory fd, for ``vm.branch`` (the host
    copies it by fd-only walks while the guest is frozen: backends/namespace/branch.py). Sent
    before any guest code runs. The last message on the control socket before the init serves."""
    socket.send_fds(ctl, [json.dumps({"upper": True}).encode()], [upper_fd])


def _become_init(root: str, req: dict[str, Any], ctl: socket.socket, report_w: int, upper_fd: int) -> None:
    """Finish the guest from inside its pid namespace, say so on ``report_w``, then serve; never returns."""
    try:
        _enter_root(root, req)
        if req.get("mapped_fd") is not None:
            _own_user_namespace(req["owner_uid"], req["mapped_fd"], report_w)
        _set_rlimits(req)
        bpf = bytes.fromhex(req["seccomp"]) if req.get("seccomp") else b""
        if bpf:
            _load_seccomp(bpf)  # after the last mount; before capabilities go
        _drop_capabilities()
    except BaseException as exc:
        os.write(report_w, json.dumps({"error": f"guest init failed: {exc}"[:4000]}).encode())
        os._exit(1)
    os.write(report_w, json.dumps({"ok": True}).encode())
    os.close(report_w)
    Init(ctl, upper_fd).serve()
    os._exit(0)
