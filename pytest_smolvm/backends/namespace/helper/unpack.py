"""``copy_in``'s unpacking inside the guest: the host's tar stream written under one directory.

Part of the namespace backend's helper (see ``__init__``): standard library only.

It runs in a request's child, inside the guest's confinement and as the request's user. The
stream is the host's own (GNU tar or ``tarfile`` made it from the user's files); the tree it
lands in is the guest's, and whatever a guest-made link there resolves to is inside the guest.
So this is no wall (``untrusted.hostfs`` is the wall, for streams going the other way); it is
here for two things the guest's own ``tar`` could not give:

- **Depth costs nothing.** Each member's directory is reached from its parent's fd, kept on a
  stack while the stream walks the tree depth first, so a member costs the same at depth 1,000
  as at depth 1. A tar resolves each member's whole path from the top (BusyBox's and GNU's
  alike), and in a guest's overlay root every level of that walk is dear: a chain of 1,200
  directories took the guest's BusyBox tar nearly 4x as long as plain ``tar`` on the host.
- **One behaviour on every image**, with or without a ``tar`` in it. It is ``tar -x -p -o``'s:
  modes as archived (setuid bits too), the request's user as owner, mtimes kept; an existing
  file or link is replaced (never written through), an existing directory, or a link to one,
  is kept and written into; a directory's mode and mtime are set once the stream has left it.
- **Small files are made by several processes** where the guest has CPUs for them
  (``writers``): in the guest's overlay root the kernel's work per file is what 10,000 small
  files cost, not the parsing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from typing import TypeVar

from pytest_smolvm.backends.namespace.helper.writers import (
    POOLED_FILE_BYTES,
    Writers,
    create_file,
    finish_file,
    set_attrs,
    write_all,
    write_file,
)

T = TypeVar("T")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
CHUNK = 1 << 20
OPEN_LEVELS = 256  # directory fds held open at most; deeper levels are reopened by path when needed
REGULAR_TYPES = (b"0", b"\0", b"7")
LINK_TYPES = (b"1", b"2")
META_TYPES = (b"L", b"K", b"x", b"g")  # headers that describe the next member
WRITERS_AFTER = 256  # small files made in-process before writers start: a small copy forks nothing

def _number(field: bytes) -> int:
    """A tar header's numeric field: octal text, or GNU's base-256 for big values."""
    if field[0] & 0x80:
        value = int.from_bytes(field[1:], "big")
        return value if field[0] == 0x80 else value - (1 << (8 * (len(field) - 1)))
    text = field.split(b"\0", 1)[0]
    try:
        return int(text, 8)  # surrounding spaces allowed
    except ValueError:
        if text.strip():
            raise OSError(errno.EINVAL, f"a tar header with a bad number, {text[:20]!r}") from None
        return 0


def _text(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def _ustar_name(header: bytes) -> bytes:
    name = _text(header[0:100])
    if header[345] and header[257:262] == b"ustar":
        return _text(header[345:500]) + b"/" + name
    return name


def _pax_records(data: bytes) -> dict[bytes, bytes]:
    records = {}
    while data:
        space = data.index(b" ")
        length = int(data[:space])
        key, _, value = data[space + 1:length - 1].partition(b"=")
        records[key] = value
        data = data[length:]
    return records


def _pax_mtime_ns(value: bytes) -> int:
    seconds, _, fraction = value.decode().partition(".")
    if seconds.startswith("-"):
        return int(float(value) * 1e9)
    return int(seconds) * 1_000_000_000 + int((fraction + "000000000")[:9])


class _Level:
    """One directory on the way down: its name, its fd (None once closed to bound open fds),
    and the mode and mtime to give it once the stream leaves it (None: it was not a member)."""

    __slots__ = ("attrs", "fd", "name")

    def __init__(self, name: bytes, fd: int | None, attrs: tuple[int, int] | None) -> None:
        self.name, self.fd, self.attrs = name, fd, attrs


class Unpacker:
    """The host's tar stream (read through ``read``) unpacked under the directory ``dest``."""

    def __init__(self, dest: str, read: Callable[[int], bytes], *, writers: int = 1, into: int | None = None) -> None:
        """``into``: the directory's fd, where it is not ``dest`` yet (a stage: stage.py); closed by ``run``."""
        self.dest = dest.rstrip("/") or "/"
        self.read = read
        self.root = os.open(dest, DIR_FLAGS) if into is None else into
        self.root_attrs: tuple[int, int] | None = None
        self.stack: list[_Level] = []
        self.names: list[bytes] = []  # the stack's names, compared in one go per member
        self.implicit_mode = 0o777  # a parent the stream did not list: as tar makes it, under the umask
        self.writers_wanted = writers
        self.small_files = 0  # made in-process, before the writers start
        self.writers: Writers | None = None

    def run(self) -> None:
        umask = os.umask(0)  # modes as archived (tar -p)
        self.implicit_mode = 0o777 & ~umask
        try:
            self._members()
            while self.read(CHUNK):
                pass  # the record's padding: the host's tar writes it all before it exits
            self._leave(0)
            if self.writers is not None:
                self.writers.close()  # every file made, every directory's attributes set
            if self.root_attrs is not None:
                set_attrs(self.root, *self.root_attrs)
        finally:
            if self.writers is not None:
                self.writers.stop()
            for level in self.stack:
                if level.fd is not None:
                    os.close(level.fd)
            os.close(self.root)
            os.umask(umask)

    def _members(self) -> None:
        read = self.read
        extended: dict[bytes, bytes] = {}  # the next member's pax records and GNU long names
        while True:
            header = read(BLOCK)
            if len(header) < BLOCK or header == ZERO_BLOCK:
                return
            kind = header[156:157]
            size = _number(header[124:136])
            if kind in META_TYPES:
                data = self._exactly(size + (-size % BLOCK))[:size]
                if kind == b"L":
                    extended[b"path"] = _text(data)
                elif kind == b"K":
                    extended[b"linkpath"] = _text(data)
                elif kind == b"x":
                    extended.update(_pax_records(data))
                continue  # "g": global records name nothing this writes
            mode = _number(header[100:108]) & 0o7777
            if extended:
                name = extended.get(b"path") or _ustar_name(header)
                size = int(extended.get(b"size", size))
                mtime = extended.get(b"mtime")
                mtime_ns = _pax_mtime_ns(mtime) if mtime else _number(header[136:148]) * 1_000_000_000
                link = extended.get(b"linkpath") or _text(header[157:257])
                extended = {}
            else:
                name = _ustar_name(header)
                mtime_ns = _number(header[136:148]) * 1_000_000_000
                link = b""  # read from the header where a link needs it
            if kind in REGULAR_TYPES and name.endswith(b"/"):
                kind = b"5"  # a pre-POSIX directory
            if name[:2] == b"./":
                name = name[2:]
            parts = name.split(b"/")
            if b"" in parts or b"." in parts:
                parts = [part for part in parts if part and part != b"."]
            try:
                if kind in REGULAR_TYPES and len(parts) == len(self.names) + 1 and parts[:-1] == self.names \
                        and b".." not in parts:
                    # Most members: a file in the directory the last one was in. No call costs
                    # here more than it must (10,000 small files: each microsecond is 10 ms).
                    self._file(parts[-1], mode, mtime_ns, size)
                else:
                    self._member(kind, parts, link or _text(header[157:257]) if kind in LINK_TYPES else b"",
                                 mode, mtime_ns, size, header)
            except OSError as exc:
                if self.writers is not None and exc is self.writers.failure:
                    raise  # a writer's, about a file of its own (the name is in it)
                shown = os.path.join(self.dest, os.fsdecode(b"/".join(parts)))
                raise OSError(exc.errno, exc.strerror or str(exc), shown) from None

    def _member(self, kind: bytes, parts: list[bytes], link: bytes, mode: int, mtime_ns: int, size: int,
                header: bytes) -> None:
        if not parts:
            if kind == b"5":
                self.root_attrs = (mode, mtime_ns)  # "." carries the tree's own mode onto dest
            return
        if b".." in parts:
            raise OSError(errno.EINVAL, "a member name with '..' in it")
        at = self._enter(parts[:-1])
        base = parts[-1]
        if kind in REGULAR_TYPES:
            self._file(base, mode, mtime_ns, size)
            return
        if size and kind != b"5":
            raise OSError(errno.EINVAL, f"a tar member of type {kind!r} with data")
        if self.writers is not None:  # what is made here is made after what a writer makes there
            self.writers.wait_for(tuple(parts))
            if kind == b"1":
                self.writers.wait_for(tuple(part for part in link.split(b"/") if part and part != b"."))
        if kind == b"5":
            with contextlib.suppress(FileExistsError):  # kept, as tar keeps it, a link to a directory too
                os.mkdir(base, (mode & 0o777) | 0o700, dir_fd=at)
            self._push(_Level(base, os.open(base, DIR_FLAGS, dir_fd=at), (mode, mtime_ns)))
        elif kind == b"1":
            target = [part for part in link.split(b"/") if part and part != b"."]
            self._replacing(lambda: os.link(b"/".join(target), base, src_dir_fd=self.root, dst_dir_fd=at,
                                            follow_symlinks=False), base, at)
        else:
            if kind == b"2":
                self._replacing(lambda: os.symlink(link, base, dir_fd=at), base, at)
            elif kind == b"6":
                self._replacing(lambda: os.mkfifo(base, mode & 0o777, dir_fd=at), base, at)
            elif kind in (b"3", b"4"):
                device = os.makedev(_number(header[329:337]), _number(header[337:345]))
                file_type = stat.S_IFCHR if kind == b"3" else stat.S_IFBLK
                self._replacing(lambda: os.mknod(base, file_type | (mode & 0o777), device, dir_fd=at), base, at)
            else:
                raise OSError(errno.EINVAL, f"cannot unpack a tar member of type {kind!r}")
            os.utime(base, ns=(mtime_ns, mtime_ns), dir_fd=at, follow_symlinks=False)

    @staticmethod
    def _replacing(make: Callable[[], T], base: bytes, at: int) -> T:
        """``make()``; where something is already there, remove it (not a directory) and retry."""
        try:
            return make()
        except FileExistsError:
            os.unlink(base, dir_fd=at)  # a directory there stays, and says so (EISDIR)
            return make()

    def _file(self, base: bytes, mode: int, mtime_ns: int, size: int) -> None:
        """A regular file in the directory the stream is in: handed to a writer when small."""
        writers = self.writers
        if writers is None and size <= POOLED_FILE_BYTES and self.writers_wanted > 1:
            self.small_files += 1
            if self.small_files > WRITERS_AFTER:
                try:
                    writers = self.writers = Writers(self.writers_wanted, self.dest)
                except OSError:  # no process to spare (the guest at its pids limit): made here
                    self.writers_wanted = 1
        top = len(self.stack) - 1
        if writers is not None:
            if size <= POOLED_FILE_BYTES and len(base) <= 255:  # a longer name: its error, made here
                data = self._exactly(size + (-size % BLOCK))
                writers.add(self.names, self._fd(top), base, mode, mtime_ns,
                            data[:size] if len(data) != size else data)
                return
            writers.wait_for((*self.names, base))
        self._write_file(self._fd(top), base, mode, mtime_ns, size)

    def _write_file(self, at: int, base: bytes, mode: int, mtime_ns: int, size: int) -> None:
        if size <= CHUNK:  # one read brings the data and its padding
            write_file(at, base, mode, mtime_ns, memoryview(self._exactly(size + (-size % BLOCK)))[:size])
            return
        fd = create_file(at, base, mode)
        try:
            self._copy(fd, size)
            finish_file(fd, mode, mtime_ns)
        finally:
            os.close(fd)

    def _copy(self, fd: int, size: int) -> None:
        left = size
        while left:
            step = min(left, CHUNK)
            # The last piece brings the member's padding with it: one read less per small file.
            chunk = self._exactly(step if step < left else step + (-size % BLOCK))
            write_all(fd, memoryview(chunk)[:step])
            left -= step

    def _exactly(self, size: int) -> bytes:
        data = self.read(size) if size else b""
        if len(data) != size:
            raise OSError(errno.EIO, "the archive ended in the middle of a member")
        return data

    # ------------------------------------------------------------------ the directory stack

    def _enter(self, parents: list[bytes]) -> int:
        """The fd of directory ``parents`` (made where missing), leaving what the stream has left."""
        if parents != self.names:
            depth = 0
            while depth < len(self.names) and depth < len(parents) and self.names[depth] == parents[depth]:
                depth += 1
            self._leave(depth)
            for name in parents[depth:]:
                at = self._fd(len(self.stack) - 1)
                if self.writers is not None:
                    self.writers.wait_for((*self.names, name))
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, self.implicit_mode, dir_fd=at)
                self._push(_Level(name, os.open(name, DIR_FLAGS, dir_fd=at), None))
        return self._fd(len(self.stack) - 1)

    def _push(self, level: _Level) -> None:
        if self.writers is not None:
            self.writers.flush()  # a batch is one directory's, sent with that directory's fd
        self.stack.append(level)
        self.names.append(level.name)
        oldest = len(self.stack) - 1 - OPEN_LEVELS
        fd = self.stack[oldest].fd if oldest >= 0 else None
        if fd is not None:
            os.close(fd)
            self.stack[oldest].fd = None

    def _leave(self, depth: int) -> None:
        """Pop the levels below ``depth``, giving each listed directory its mode and mtime."""
        while len(self.stack) > depth:
            level = self.stack[-1]
            if self.writers is not None:
                self.writers.flush()  # before the directory's fd is closed
            if level.attrs is not None:
                at = self._fd(len(self.stack) - 1)
                if self.writers is not None and self.writers.busy(self.names):
                    self.writers.set_attrs(self.names, at, *level.attrs)  # after its files
                else:
                    set_attrs(at, *level.attrs)
            self.stack.pop()
            self.names.pop()
            if level.fd is not None:
                os.close(level.fd)

    def _fd(self, index: int) -> int:
        """Level ``index``'s fd (the destination's for -1), reopened from the nearest open one above."""
        if index < 0:
            return self.root
        level = self.stack[index]
        if level.fd is None:
            above = index - 1
            while above >= 0 and self.stack[above].fd is None:
                above -= 1
            path = b"/".join(self.names[above + 1:index + 1])
            level.fd = os.open(path, DIR_FLAGS, dir_fd=self._fd(above))
        return level.fd
