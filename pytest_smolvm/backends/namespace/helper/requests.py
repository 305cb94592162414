"""What one request's child does inside the guest: exec a program, or one file operation.

Part of the namespace backend's helper (see ``__init__``): standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import tarfile
from typing import Any

from pytest_smolvm.backends.namespace.helper.kernel import SIGNAL_EXIT_BASE
from pytest_smolvm.backends.namespace.helper.stage import MERGE_ERRORS, is_stage_name, merge, open_stage
from pytest_smolvm.backends.namespace.helper.unpack import Unpacker

# tarfile looks owners up by name through NSS, which dlopen()s libraries from the *guest's*
# root once we are inside it. Never load guest-provided code into a privileged process.
tarfile.pwd = None  # type: ignore[attr-defined]
tarfile.grp = None  # type: ignore[attr-defined]

STATUS_FD = 3  # in a request's child: where it reports a structured error


MAX_BODY = 64 << 20  # a request body (memfd) beyond this is refused; ARG_MAX is at most 6 MiB


class UserError(Exception):
    """The request's user is not known in the guest, or cannot be switched to."""


class Refused(Exception):
    """A request stopped at one of its limits; the message (naming it) is the host's error."""


def _report(fd: int, message: dict[str, Any]) -> None:
    try:
        os.write(fd, json.dumps(message).encode())
    except OSError:
        pass  # the host stopped listening: nothing to tell


def _error(exc: OSError, filename: Any, what: str) -> dict[str, Any]:
    error: dict[str, Any] = {"errno": exc.errno, "strerror": exc.strerror or str(exc),
                             "filename": exc.filename if isinstance(exc.filename, str) else filename,
                             "what": what}
    if exc.errno == errno.E2BIG:
        error["arg_max"] = os.sysconf("SC_ARG_MAX")
    return error


def _read_body(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    if size > MAX_BODY:
        raise ValueError(f"request body of {size} bytes is over {MAX_BODY}")
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _guest_table(path: str) -> list[list[str]]:
    """/etc/passwd or /etc/group of the guest, parsed here: the guest's NSS modules never load.

    This runs in the request's child, never in pid 1: a guest that made the file a FIFO or
    a huge file stalls only this request, which the host's timeout kills.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{path} in the guest is not a regular file")
        data = os.read(fd, 4 << 20)
    finally:
        os.close(fd)
    return [line.split(":") for line in data.decode("utf-8", "replace").splitlines()
            if line and not line.startswith("#")]


def _lookup_user(user: str | int) -> tuple[str, int, int, list[int], str]:
    """(name, uid, gid, supplementary gids, home) of a guest user given by name or uid."""
    try:
        users = _guest_table("/etc/passwd")
    except FileNotFoundError:
        users = []
    wanted = str(user)
    entry = next((e for e in users if len(e) >= 6 and e[0] == wanted), None)
    if entry is None and wanted.isdigit():
        entry = next((e for e in users if len(e) >= 6 and e[2] == wanted), None)
    if entry is None:
        raise UserError(f"user {user!r} is not in the guest's /etc/passwd")
    try:
        name, uid, gid, home = entry[0], _id(entry[2]), _id(entry[3]), entry[5] or "/"
    except ValueError:
        raise UserError(f"user {user!r} has a malformed /etc/passwd entry in the guest") from None
    groups = {gid}
    try:
        for group in _guest_table("/etc/group"):
            if len(group) >= 4 and name in group[3].split(","):
                with contextlib.suppress(ValueError):  # a malformed line names no group, as for libc
                    groups.add(_id(group[2]))
    except FileNotFoundError:
        pass
    return name, uid, gid, sorted(groups), home


def _id(text: str) -> int:
    """A uid or gid from the guest's tables: the kernel's range (2**32 - 1 is "no id"), else
    ValueError; a bigger one made setuid raise OverflowError, past the request's error report."""
    value = int(text)
    if not 0 <= value < 0xFFFFFFFF:
        raise ValueError(text)
    return value


def _become(message: dict[str, Any]) -> None:
    """Switch this request's child to the request's user: groups, gid, uid, and its HOME."""
    name, uid, gid, groups, home = _lookup_user(message["user"])
    try:
        if (uid, gid) == (os.getuid(), os.getgid()):
            try:
                os.setgroups(groups)
            except PermissionError:
                pass  # already this user; a user namespace that maps only root cannot set groups
        else:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
    except OSError as exc:
        raise UserError(f"cannot switch to user {message['user']!r} (uid {uid}): {exc.strerror}; "
                        "an unprivileged host's guest maps only root") from None
    if message["op"] == "exec":
        explicit = set(message.get("explicit", ()))
        for key, value in (("HOME", home), ("USER", name), ("LOGNAME", name)):
            if key not in explicit:
                message["env"][key] = value


# What a spawned command starts with: default dispositions for what the init catches (see
# Init.__init__) and for SIGXFSZ, which Python ignores and execve would pass on ignored.
SPAWN_DEFAULT_SIGNALS = (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE, signal.SIGINT, signal.SIGXFSZ)


def _spawn_vpe(argv: list[str], env: dict[str, str], fds: list[int]) -> int:
    """posix_spawn with os.execvpe's PATH search: same candidates, same order, same error raised."""
    file = argv[0]
    candidates = [file] if os.path.dirname(file) else [os.path.join(d, file) for d in os.get_exec_path(env)]
    last_exc: OSError | None = None
    saved_exc: OSError | None = None
    for path in candidates:
        try:
            # A stat skips the candidates execve would refuse with ENOENT/ENOTDIR anyway:
            # a PATH search then costs one spawn, not one per PATH entry.
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError) as exc:
            last_exc = exc
            continue
        except OSError:
            pass  # let execve itself say what is wrong
        try:
            return os.posix_spawn(path, argv, env, setsid=True, setsigdef=SPAWN_DEFAULT_SIGNALS,
                                  file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)])
        except (FileNotFoundError, NotADirectoryError) as exc:
            last_exc = exc
        except OSError as exc:
            last_exc = exc
            if saved_exc is None:
                saved_exc = exc
    raise saved_exc or last_exc or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), file)


def _open_regular(path: str, flags: int) -> int:
    """Open ``path`` in the guest, refusing anything but a regular file before any byte moves.

    O_NONBLOCK: opening a FIFO the guest planted must not wait for a writer (or reader).
    """
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket)", path)
    os.set_blocking(fd, True)
    return fd


def _exec(message: dict[str, Any]) -> None:
    """Exec in a forked child (an exec as another user); errors go to the status socket."""
    env = message["env"]
    argv = message["argv"]
    cwd = message.get("cwd") or "/"
    try:
        os.chdir(cwd)
    except OSError as exc:
        _report(STATUS_FD, {"error": _error(exc, cwd, "workdir")})
        os._exit(126)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        _report(STATUS_FD, {"error": _error(exc, argv[0], "exec")})
        os._exit(127 if exc.errno == errno.ENOENT else 126)


def _op_write(message: dict[str, Any]) -> int:
    path = message["path"]
    parent = os.path.dirname(path) or "/"
    os.makedirs(parent, exist_ok=True)
    fd = _open_regular(path, os.O_WRONLY | os.O_CREAT)
    os.ftruncate(fd, 0)
    with open(fd, "wb") as f, os.fdopen(0, "rb", closefd=False) as src:
        shutil.copyfileobj(src, f, 1 << 20)
        if message.get("mode") is not None:
            os.fchmod(f.fileno(), message["mode"])
    return 0


def _op_read(message: dict[str, Any]) -> int:
    limit = int(message.get("limit") or 0)
    with open(_open_regular(message["path"], os.O_RDONLY), "rb") as f, \
            os.fdopen(1, "wb", closefd=False) as dst:
        sent = 0
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return 0
            sent += len(chunk)
            if limit and sent > limit:
                raise OSError(errno.EFBIG, f"File too large: over read_file's max_bytes={limit} "
                                           "(pass a larger max_bytes, or use copy_out)", message["path"])
            dst.write(chunk)


# How deep a warm baseline's tree may nest (a guest's export names this limit when it stops).
EXPORT_DEPTH = 1024
GUEST_TARS = ("/bin/tar", "/usr/bin/tar")


def _op_put_archive(message: dict[str, Any]) -> int:
    dest = message["path"]
    writers = int(message.get("writers", 1))
    with os.fdopen(0, "rb", buffering=1 << 16, closefd=False) as src:
        stage = open_stage(dest, message.get("stage"))
        if stage is None:
            os.makedirs(dest, exist_ok=True)
            Unpacker(dest, src.read, writers=writers).run()
            return 0
        name, fd = stage
        staged = f"/{name}"
        try:
            unpacker = Unpacker(dest, src.read, writers=writers, into=fd)
            unpacker.run()
            try:
                os.rename(staged, dest)  # through the overlay, which looks the tree up only now
            except OSError as exc:
                if exc.errno not in MERGE_ERRORS or not os.path.isdir(dest):
                    raise OSError(exc.errno, exc.strerror, dest) from None  # the stage is no name of the user's
                merge(staged, dest, unpacker.root_attrs)  # dest was made meanwhile
        finally:
            shutil.rmtree(staged, ignore_errors=True)  # gone once moved; what is left, after a failure
    return 0


def _op_discard_stage(message: dict[str, Any]) -> int:
    """Remove what a killed ``put_archive`` had staged (the host asks after a failed copy)."""
    name = message["path"].lstrip("/")
    if not is_stage_name(name):
        raise Refused(f"discard_stage: {message['path']!r} is not a staged tree")
    shutil.rmtree(f"/{name}", ignore_errors=True)
    return 0


def _op_get_archive(message: dict[str, Any]) -> int:
    path = message["path"]
    st = os.lstat(path)  # a clear "No such file" before any byte of archive is written
    if stat.S_ISDIR(st.st_mode):
        for tar_path in GUEST_TARS:
            if os.access(tar_path, os.X_OK):
                return _tar_tree(tar_path, path)
    with os.fdopen(1, "wb", closefd=False) as dst, tarfile.open(fileobj=dst, mode="w|") as tar:
        tar.add(path, arcname=message["arcname"], recursive=True)
    return 0


def _tar_tree(tar_path: str, path: str) -> int:
    """A guest directory as a tar stream written by the guest's own tar (much faster than tarfile).

    The guest controls its tar, but it controls the stream anyway: the host parses it as
    hostile either way. Members are named relative to the tree (".", "./sub/file"), which the
    host puts under the name it asked for: BusyBox tar cannot rename members.
    """
    # Entered by fd without following a link: the tree is the directory that was checked,
    # and an unreadable top is a PermissionError, as tarfile would raise.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchdir(fd)
    finally:
        os.close(fd)
    # Its stderr goes to a memfd, not a pipe: a process the guest's tar leaves behind could
    # hold a pipe open, and this child would wait for its end forever.
    err = os.memfd_create("tar-stderr", os.MFD_CLOEXEC)
    try:
        devnull = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        try:
            pid = os.posix_spawn(tar_path, [tar_path, "-c", "-f", "-", "."], dict(os.environ),
                                 setsigdef=SPAWN_DEFAULT_SIGNALS,
                                 file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, err, 2)])
        finally:
            os.close(devnull)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        tail = os.pread(err, 1 << 16, max(0, os.fstat(err).st_size - (1 << 16)))
    finally:
        os.close(err)
    lines = [line for line in tail.decode(errors="replace").splitlines() if line.strip()]
    if code == 1 and lines and all("file changed as we read it" in line for line in lines):
        return 0  # GNU tar's "some files changed": the archive is complete, as tarfile's would be
    if code != 0:
        if any("Permission denied" in line for line in lines):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        os.write(2, tail)
        return code if code > 0 else SIGNAL_EXIT_BASE - code
    return 0


def _op_export_root(message: dict[str, Any]) -> int:
    """The guest's whole root filesystem as a tar, without what is mounted on it (/proc, /dev).

    This is how a prepared (warm) guest becomes a baseline: the host unpacks this tree once
    and forks later guests from it.
    """
    root_dev = os.lstat("/").st_dev
    with os.fdopen(1, "wb", closefd=False) as dst, tarfile.open(fileobj=dst, mode="w|") as tar:
        # Depth first in sorted order, by a stack: one Python frame per level made a 1,200-level
        # tree end in a RecursionError; a tree deeper than EXPORT_DEPTH is refused by name.
        pending = [("/" + entry, entry, 1) for entry in sorted(os.listdir("/"), reverse=True)]
        while pending:
            path, arcname, depth = pending.pop()
            info = tar.gettarinfo(path, arcname)
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
                continue
            if info.ischr() or info.isblk():
                continue  # overlay whiteouts and devices: the baseline gets its own /dev
            tar.addfile(info)
            if info.isdir() and os.lstat(path).st_dev == root_dev:
                entries = sorted(os.listdir(path), reverse=True)
                if entries and depth >= EXPORT_DEPTH:
                    raise Refused(f"{path[:200]}... is deeper than {EXPORT_DEPTH} directories (the limit "
                                    "of a warm baseline's tree)")
                pending.extend((os.path.join(path, entry), f"{arcname}/{entry}", depth + 1) for entry in entries)
    return 0


FILE_OPS = {"write": _op_write, "read": _op_read, "put_archive": _op_put_archive,
            "discard_stage": _op_discard_stage, "get_archive": _op_get_archive, "export_root": _op_export_root}
