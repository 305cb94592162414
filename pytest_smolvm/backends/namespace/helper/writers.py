"""Making files in a guest: the functions ``copy_in``'s unpacker makes each file with, and the
writer processes that make small files beside it.

Part of the namespace backend's helper (see ``__init__``): standard library only. Like the
unpacker (``unpack``), it runs in a request's child inside the guest's confinement, as the
request's user; the writers are that child's own forks, in its process group, so they carry the
same confinement and the host's kill of the request reaches them.

Why writers: in a guest's overlay root the kernel's work per file (create, write, utime, close)
is about twice a plain filesystem's, and for 10,000 small files it, not the parsing, is the
cost. Directories' files made at once by two processes take about half as long where the guest
has two CPUs (docs/performance.md).
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import select
import socket
import struct
from collections import deque
from typing import NoReturn

FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
WRITERS_MAX = 4  # writer processes one unpack starts at most, the guest's CPUs permitting
POOLED_FILE_BYTES = 16 << 10  # a larger file is made by the parser itself, beside the writers
BATCH_BYTES = 64 << 10  # one message to a writer: a directory's files, up to this much
MESSAGE_BYTES = BATCH_BYTES + POOLED_FILE_BYTES + 4096  # the most one message holds
ENTRY = struct.Struct("!HIqI")  # a pooled file: name length, mode, mtime (ns), size
ATTRS = struct.Struct("!Iq")  # a directory's mode and mtime (ns)
REPLY = struct.Struct("!iI")  # errno (0: all made) and the index of the file that failed
FILES_OP, ATTRS_OP = b"F", b"A"


def writers_for(cpus: float) -> int:
    """How many writer processes an unpack in a guest allowed ``cpus`` CPUs starts (1: none)."""
    return max(1, min(WRITERS_MAX, int(cpus)))


def create_file(at: int, base: bytes, mode: int) -> int:
    try:
        return os.open(base, FILE_FLAGS, mode & 0o777, dir_fd=at)
    except FileExistsError:
        os.unlink(base, dir_fd=at)  # replaced, never written through
        return os.open(base, FILE_FLAGS, mode & 0o777, dir_fd=at)


def finish_file(fd: int, mode: int, mtime_ns: int) -> None:
    if mode & 0o7000:
        os.fchmod(fd, mode)
    os.utime(fd, ns=(mtime_ns, mtime_ns))


def write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def write_file(at: int, base: bytes, mode: int, mtime_ns: int, data: bytes | memoryview) -> None:
    """File ``base`` in directory ``at`` made anew with ``data``, ``mode`` and ``mtime_ns``."""
    fd = create_file(at, base, mode)
    try:
        if data:
            written = os.write(fd, data)
            if written != len(data):
                write_all(fd, memoryview(data)[written:])
        finish_file(fd, mode, mtime_ns)
    finally:
        os.close(fd)


def set_attrs(at: int | str, mode: int, mtime_ns: int) -> None:
    """A directory's mode and mtime, by fd (or by path: stage.py ``merge``)."""
    os.chmod(at, mode)
    os.utime(at, ns=(mtime_ns, mtime_ns))


class Writers:
    """Forked processes that make the stream's small files while the parser reads on.

    Each directory's files go to one writer (picked by the directory's path), in stream order,
    and the directory's mode and mtime go to the same writer after them: so a name written
    twice lands as the stream's last, and a directory's mtime is set after its last file.
    Whatever the parser makes itself (a directory, a link, a large file) waits until no writer
    still has that path, or the link's target, in hand. The parser hands over a batch of one
    directory's files at a time with the directory's fd (SCM_RIGHTS), so a writer makes them
    exactly where the parser would have; each batch is answered, an error with the index of
    the file that failed. Writers share the request's process group (the host's kill reaches
    them) and exit when the parser's end of their socket closes.
    """

    def __init__(self, count: int, dest: str) -> None:
        self.dest = dest  # for the path an error names
        self.socks: list[socket.socket] = []
        self.pids: list[int] = []
        # per writer, the batches sent and not yet answered: (directory, names of its files)
        self.in_flight: list[deque[tuple[tuple[bytes, ...], list[bytes]]]] = []
        self.pending_paths: dict[tuple[bytes, ...], int] = {}
        self.pending_dirs: dict[tuple[bytes, ...], int] = {}
        self.failure: OSError | None = None
        self.batch: list[bytes] = []
        self.batch_names: list[bytes] = []
        self.batch_bytes = 0
        self.batch_dir: tuple[bytes, ...] = ()
        self.batch_fd = -1
        try:
            for _ in range(count):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                pid = os.fork()
                if pid == 0:
                    _writer_main(theirs)
                theirs.close()
                ours.setblocking(False)
                self.socks.append(ours)
                self.pids.append(pid)
                self.in_flight.append(deque())
        except BaseException:
            self.stop()
            raise

    # ---- what the parser calls

    def add(self, names: list[bytes], at: int, base: bytes, mode: int, mtime_ns: int, data: bytes) -> None:
        """File ``base`` in the directory the parser is in (``names``, open as ``at``). The parser
        calls :meth:`flush` whenever it enters or leaves a directory."""
        if not self.batch:
            self.batch_dir, self.batch_fd = tuple(names), at
        self.batch.append(ENTRY.pack(len(base), mode, mtime_ns, len(data)))
        self.batch.append(base)
        self.batch.append(data)
        self.batch_names.append(base)
        self.batch_bytes += ENTRY.size + len(base) + len(data)
        if self.batch_bytes >= BATCH_BYTES:
            self.flush()

    def busy(self, names: list[bytes]) -> bool:
        """Whether a writer may still make files in this directory (batches flushed)."""
        return tuple(names) in self.pending_dirs

    def set_attrs(self, names: list[bytes], at: int, mode: int, mtime_ns: int) -> None:
        """The directory's mode and mtime, set by its writer after its files (batches flushed)."""
        self._send(tuple(names), [], ATTRS_OP + ATTRS.pack(mode, mtime_ns), at)

    def wait_for(self, path: tuple[bytes, ...]) -> None:
        """Return once no writer has ``path`` in hand."""
        if self.batch and path[:-1] == self.batch_dir and path[-1] in self.batch_names:
            self.flush()
        while path in self.pending_paths:
            self._collect(block=True)

    def close(self) -> None:
        """Wait for every batch to be made; raise the first writer's error."""
        self.flush()
        while any(self.in_flight):
            self._collect(block=True)
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        """Let the writers finish what they have in hand, then reap them: after an error in the
        stream, the files before it land whole, as they do made in-process."""
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)  # a writer reads the end once its batches are made
        for sock in self.socks:
            sock.setblocking(True)
            with contextlib.suppress(OSError):
                while sock.recv(MESSAGE_BYTES):
                    pass  # answers are never empty: this is the writer's exit
            sock.close()
        for pid in self.pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.socks, self.pids = [], []

    # ---- the batches

    def flush(self) -> None:
        """Send the batch in hand to its directory's writer."""
        if not self.batch:
            return
        message = b"".join([FILES_OP, *self.batch])
        names = self.batch_names
        self.batch, self.batch_names, self.batch_bytes = [], [], 0
        self._send(self.batch_dir, names, message, self.batch_fd)

    def _send(self, directory: tuple[bytes, ...], names: list[bytes], message: bytes, at: int) -> None:
        writer = hash(directory) % len(self.socks)
        for name in names:
            path = (*directory, name)
            self.pending_paths[path] = self.pending_paths.get(path, 0) + 1
        self.pending_dirs[directory] = self.pending_dirs.get(directory, 0) + 1
        self.in_flight[writer].append((directory, names))
        sock = self.socks[writer]
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [at]))]
        while True:
            try:
                sock.sendmsg([message], rights, socket.MSG_NOSIGNAL)
                return
            except BlockingIOError:
                # The writer is behind: read the answers meanwhile, so that neither side
                # waits on the other with both sockets full.
                self._collect(block=True, writable=sock)
            except OSError as exc:
                self._fail(OSError(errno.EIO, f"a writer process died ({exc})"))

    def _collect(self, *, block: bool, writable: socket.socket | None = None) -> None:
        """Take the writers' answers; with ``block``, wait for at least one (or ``writable``)."""
        if block:
            poller = select.poll()
            for index, sock in enumerate(self.socks):
                events = select.POLLIN if self.in_flight[index] else 0
                if sock is writable:
                    events |= select.POLLOUT
                if events:
                    poller.register(sock, events)
            poller.poll()
        for index, sock in enumerate(self.socks):
            while self.in_flight[index]:
                try:
                    reply = sock.recv(MESSAGE_BYTES)
                except BlockingIOError:
                    break
                except OSError as exc:
                    self._fail(OSError(errno.EIO, f"a writer process died ({exc})"))
                if len(reply) < REPLY.size:
                    self._fail(OSError(errno.EIO, "a writer process died"))
                code, failed = REPLY.unpack_from(reply)
                directory, names = self.in_flight[index].popleft()
                for name in names:
                    path = (*directory, name)
                    left = self.pending_paths[path] - 1
                    if left:
                        self.pending_paths[path] = left
                    else:
                        del self.pending_paths[path]
                left = self.pending_dirs[directory] - 1
                if left:
                    self.pending_dirs[directory] = left
                else:
                    del self.pending_dirs[directory]
                if code:
                    where = os.fsdecode(b"/".join((*directory, *names[failed:failed + 1])))
                    self._fail(OSError(code, reply[REPLY.size:].decode(errors="replace"),
                                       os.path.join(self.dest, where) if where else self.dest))

    def _fail(self, error: OSError) -> NoReturn:
        if self.failure is None:
            self.failure = error
        raise self.failure


def _writer_main(sock: socket.socket) -> None:
    """A writer process: make each batch the parser sends, answer, and exit at its end."""
    code = 1
    try:
        keep = sock.fileno()
        os.closerange(0, 2)  # the stream and stdout are the parser's; stderr stays, for a traceback
        os.closerange(3, keep)
        os.closerange(keep + 1, 65536)
        while True:
            message, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 1)
            if not message:
                code = 0
                break
            sock.send(_make_batch(message, fds[0] if fds else -1))
            for fd in fds:
                os.close(fd)
    except BaseException:
        with contextlib.suppress(BaseException):
            import traceback
            traceback.print_exc()
    os._exit(code)


def _make_batch(message: bytes, at: int) -> bytes:
    index = 0
    try:
        if message[:1] == ATTRS_OP:
            set_attrs(at, *ATTRS.unpack_from(message, 1))
            return REPLY.pack(0, 0)
        view, offset = memoryview(message), 1
        while offset < len(message):
            name_size, mode, mtime_ns, size = ENTRY.unpack_from(message, offset)
            offset += ENTRY.size
            base = message[offset:offset + name_size]
            offset += name_size
            write_file(at, base, mode, mtime_ns, view[offset:offset + size])
            offset += size
            index += 1
    except OSError as exc:
        return REPLY.pack(exc.errno or errno.EIO, index) + (exc.strerror or str(exc)).encode(errors="replace")
    return REPLY.pack(0, 0)
