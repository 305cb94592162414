"""A guest's operations, written once: :class:`GuestHandle` is what ``VM`` and ``AsyncVM`` share.

Backend-agnostic: all guest I/O goes through a :class:`~pytest_smolvm.backends.base.Guest`. The
async twin (:mod:`.aio`) is built from these methods, so both take the same parameters, with the
same defaults and errors, by construction.
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, cast

from pytest_smolvm import limits
from pytest_smolvm.errors import ClosedError, GuestError, GuestFileNotFoundError, UsageError
from pytest_smolvm.limits import guest_env, guest_timeout, guest_user
from pytest_smolvm.untrusted import confined, rules
from pytest_smolvm.untrusted.walk import rmtree

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; only the checker reads it

    from pytest_smolvm.backends.base import Cancel, Guest, OutputCallback, VMSpec

from pytest_smolvm.handle.result import DEFAULT, ExecResult, Timeout, TranscriptEntry, _Omitted

PAYLOAD = "payload"
MAX_BRANCHES = 64  # children per call: a typo (branch_batch(10_000)) fails at once, not at the host's limits


class Brancher(Protocol):
    """What the guest's owner (the test's fixture, a ``Session``) gives its handle so that it
    can branch: children made as the owner's own guests (session/branching.py)."""

    def branch(self, n: int, *, throwaway: bool = False) -> list[GuestHandle]:
        """``n`` children, all or none; ``throwaway``: not handed to the owner (the caller
        discards it; the pool's close and the reaper still know it)."""
        ...

    def discard(self, child: GuestHandle) -> None:
        """Destroy ``child`` now (a ``reward`` branch); never raises."""
        ...


class GuestHandle:
    """One guest's operations; every method talks to that guest only."""

    def __init__(self, guest: Guest, *, default_timeout: float | None = None,
                 backend: str = "", isolation: str = "", baseline: str = "", digest: str = "",
                 user: str | int | None = None, output_limit: int | None = None) -> None:
        self._guest = guest
        self.default_timeout = default_timeout
        self.user = user  # every exec and file operation runs as this guest user (None: the image's)
        # None: the default read now (not bound at import: a conftest may replace limits.LIMITS)
        self.output_limit = output_limit if output_limit is not None else limits.LIMITS.output_bytes
        self.backend = backend
        self.isolation = isolation
        self.baseline = baseline
        self.digest = digest
        self.transcript: list[TranscriptEntry] = []
        self._brancher: Brancher | None = None  # set by the guest's owner (session/branching.py)
        self._retired = False  # its owner handed the guest to its teardown (:meth:`retire`)

    @classmethod
    def for_spec(cls, guest: Guest, spec: VMSpec, *, backend: str, isolation: str) -> Self:
        """The handle of ``guest``, made from ``spec``: its user, output limit and exec timeout
        are the resolved spec's (session/spec.py), never resolved again here."""
        return cls(guest, default_timeout=spec.timeout, backend=backend, isolation=isolation,
                   baseline=spec.baseline.reference, digest=spec.baseline.digest, user=spec.user,
                   output_limit=spec.output_limit)

    @property
    def name(self) -> str:
        return self._guest.name

    @property
    def workdir(self) -> str:
        """The guest's working directory (the image's ``WorkingDir``, else ``/``): relative
        guest paths and a relative ``workdir`` resolve against it."""
        return str(getattr(self._guest, "workdir", None) or "/")

    # ------------------------------------------------------------------ exec

    def exec(self, cmd: str | Sequence[str], *, timeout: Timeout = DEFAULT,
             env: Mapping[str, str] | None = None, workdir: str | None = None,
             stdin: str | bytes | None = None, user: str | int | None = None, check: bool = False,
             on_output: OutputCallback | None = None) -> ExecResult:
        """Run ``cmd`` in the guest: a string through ``/bin/sh -c``, a list as argv.

        ``timeout`` (seconds; omitted: the marker's ``timeout``; ``None``: no limit) kills the
        command's process group in the guest and returns ``timed_out=True``; the test process
        is untouched. ``user`` (name or uid in the guest) runs it as that user. ``on_output``
        gets ``("stdout" | "stderr", bytes)`` chunks as they arrive. An argv whose program is
        missing or not executable raises ``FileNotFoundError``/``PermissionError``.
        """
        return self._exec_cancellable(cmd, timeout=timeout, env=env, workdir=workdir, stdin=stdin, user=user,
                          check=check, on_output=on_output, cancel=None)

    def _exec_cancellable(self, cmd: str | Sequence[str], *, timeout: Timeout = DEFAULT,
                          env: Mapping[str, str] | None = None, workdir: str | None = None,
                          stdin: str | bytes | None = None, user: str | int | None = None, check: bool = False,
                          on_output: OutputCallback | None = None, cancel: Cancel | None = None) -> ExecResult:
        """:meth:`exec`, plus a :class:`Cancel` that kills the command (the async twin's)."""
        self._check_live("exec")
        if isinstance(cmd, str):
            argv, shown = ["/bin/sh", "-c", cmd], cmd
        elif isinstance(cmd, Sequence) and all(isinstance(a, (str, os.PathLike)) for a in cmd):
            argv = [os.fspath(a) for a in cmd]
            if not argv:
                raise ValueError("exec: cmd is an empty list")
            shown = " ".join(argv)
        else:
            raise TypeError(f"exec: cmd must be a string (run by /bin/sh -c) or a list of strings (an argv), "
                            f"got {cmd!r}")
        if any("\0" in arg for arg in argv):
            raise ValueError(f"exec: cmd holds a NUL byte, which no argv can carry: {shown!r}")
        if on_output is not None and not callable(on_output):
            raise TypeError(f"exec: on_output must be a callable (stream, chunk), got {on_output!r}")
        if not isinstance(check, bool):  # check="no" would raise on a failure the caller meant to read
            raise TypeError(f"exec: check must be True or False, got {check!r}")
        environment = guest_env("exec: env", env) if env is not None else {}
        limit = self.default_timeout if isinstance(timeout, _Omitted) else timeout
        if limit is not None:  # checked before the command starts: nothing runs on a bad timeout
            limit = guest_timeout("exec: timeout", limit)
        data = None if stdin is None else _as_bytes(stdin, "exec: stdin")
        run_as = guest_user("exec: user", user) if user is not None else self.user
        where = self._guest_path(workdir, "exec") if workdir else None
        started = time.monotonic()
        # Entered before the command is sent, completed when it ends: a wait that never returns
        # (pytest-timeout's signal, a KeyboardInterrupt, an abandoned aio exec) still shows it.
        entry = TranscriptEntry(shown, None, 0.0, started=started)
        self.transcript.append(entry)
        try:
            raw = self._guest.exec(argv, env=environment, workdir=where, stdin=data, timeout=limit,
                                   output_limit=self.output_limit, user=None if run_as is None else str(run_as),
                                   on_output=on_output, cancel=cancel)
        except BaseException as exc:
            entry.interrupted_by(exc)
            raise
        result = ExecResult(shown, raw.exit_code, raw.stdout.decode("utf-8", "replace"),
                            raw.stderr.decode("utf-8", "replace"), time.monotonic() - started,
                            raw.timed_out, raw.stdout, raw.stderr, raw.truncated)
        entry.ended(result, cancelled=raw.cancelled)
        return result.check() if check else result

    # ------------------------------------------------------------------ branches

    def branch(self) -> Self:
        """A new guest whose state is this guest's state now; then each goes its own way.

        The child belongs to this guest's owner (the test or the Session) and is destroyed with
        it. smol: memory and disk are carried; namespace: the filesystem only (no processes).
        """
        return self.branch_batch(1)[0]

    def branch_batch(self, n: int) -> list[Self]:
        """``n`` children at once (see :meth:`branch`): all made, or none (an error leaves none)."""
        return cast("list[Self]", brancher_of(self).branch(batch_size(n)))  # the owner makes our kind

    def reward(self, cmd: str | Sequence[str], *, timeout: Timeout = DEFAULT,
               env: Mapping[str, str] | None = None, workdir: str | None = None,
               stdin: str | bytes | None = None, user: str | int | None = None, check: bool = False,
               on_output: OutputCallback | None = None) -> ExecResult:
        """Run ``cmd`` (as :meth:`exec`) in a throwaway branch of this guest, destroyed right
        after whatever happens: a grader's writes and processes never touch the episode."""
        brancher = brancher_of(self)
        child = brancher.branch(1, throwaway=True)[0]
        try:
            return child.exec(cmd, timeout=timeout, env=env, workdir=workdir, stdin=stdin, user=user,
                              check=check, on_output=on_output)
        finally:
            brancher.discard(child)

    # ------------------------------------------------------------------ files

    def write_file(self, path: str, data: str | bytes, *, mode: int | None = None) -> None:
        """Write ``data`` (text is UTF-8 encoded) to ``path`` in the guest, creating parent dirs.

        Guest refusals raise ``OSError`` subclasses (``PermissionError``, ...) naming the path.
        """
        path = self._guest_path(path, "write_file")
        if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777):
            raise ValueError(f"write_file: mode must be an int from 0 to 0o7777 (0o644, say), got {mode!r}")
        self._guest.write_file(path, _as_bytes(data, "write_file: data"), mode, user=self._user())

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The bytes of guest file ``path``; a file over ``max_bytes`` (None: ``LIMITS.read_bytes``,
        read now) raises ``OSError(EFBIG)``."""
        if max_bytes is None:
            max_bytes = limits.LIMITS.read_bytes
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"read_file: max_bytes must be a positive integer, got {max_bytes!r}")
        path = self._guest_path(path, "read_file")
        return self._guest.read_file(path, max_bytes=max_bytes, user=self._user())

    def copy_in(self, src: str | os.PathLike[str], dest: str) -> None:
        """Copy a host file or tree to ``dest`` in the guest (modes kept, links copied as links)."""
        dest = self._guest_path(dest, "copy_in")
        source = _host_path(src, "copy_in: src")
        if not source.exists() and not source.is_symlink():
            raise FileNotFoundError(f"copy_in: no such host file or directory: {source}")
        parent, base = os.path.split(dest.rstrip("/") or "/")
        if not base:
            raise ValueError("copy_in: dest must name a file or directory, not /")

        if source.is_dir() and not source.is_symlink():
            # A tree is extracted *into* dest ("." carries the tree's own mode onto dest).
            target_dir, arcname = dest.rstrip("/"), "."
        else:
            target_dir, arcname = parent or "/", base

        def produce(out: IO[bytes]) -> None:
            if arcname == "." and _host_gnu_tar() and _tar_with_gnu_tar(source, out):
                return
            with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                tar.add(source, arcname=arcname, recursive=True, filter=_owned_by_guest_root)

        self._guest.put_archive(target_dir, produce, user=self._user())

    def copy_out(self, src: str, dest: str | os.PathLike[str], *, max_bytes: int | None = None,
                 timeout: float | None = None) -> Path:
        """Copy a guest file or tree to ``dest`` on the host; returns where the copy is.

        ``dest`` names the copy, unless it is an existing directory: then the copy goes inside
        it, under ``src``'s own name (``copy_out("/work/out", ".")`` makes ``./out``), and a
        directory already there by that name is replaced, as a file is.

        The guest controls what arrives, so it is unpacked by :mod:`pytest_smolvm.untrusted.hostfs`'s
        rules: nothing is written outside ``dest``, no guest-made link is followed, links that
        point outside the copied tree, devices and FIFOs are refused, and at most ``max_bytes``
        (default 4 GiB) arrive within ``timeout`` seconds (default 900).
        """
        src = self._guest_path(src, "copy_out")
        _host_path(dest, "copy_out: dest")
        defaults = rules.Caps()
        caps = rules.Caps(
            max_bytes=defaults.max_bytes if max_bytes is None else int(_positive_limit(max_bytes, "copy_out")),
            timeout=defaults.timeout if timeout is None else _positive_limit(timeout, "copy_out", "timeout"))
        target = Path(dest)
        if target.is_symlink():
            raise GuestError(f"copy_out: destination {target} is a symlink; refusing to write through it")
        if target.is_dir():
            # Into an existing directory, as cp and docker cp do: replacing it instead would
            # empty "." (staging dir included) or a whole project for a copy_out(src, ".").
            name = posixpath.basename(src.rstrip("/"))
            if not name or name in (".", ".."):
                raise GuestError(f"copy_out: {src} has no name to give its copy inside the directory {target}")
            target = target / name
            if target.is_symlink():
                raise GuestError(f"copy_out: destination {target} is a symlink; refusing to write through it")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".smolvm-copy-", dir=target.parent))
        try:
            def consume(stream: IO[bytes]) -> None:
                confined.extract(stream, staging, rules.Policy(f"copy_out of {src}", prefix=PAYLOAD), caps)

            try:
                self._guest.get_archive(src, PAYLOAD, consume, user=self._user())
            except FileNotFoundError as exc:
                # The guest's own answer names the guest path; a host-side one (staging) does not.
                if isinstance(exc, GuestError) or posixpath.normpath(str(exc.filename)) != posixpath.normpath(src):
                    raise
                raise GuestFileNotFoundError("copy_out", src) from None
            payload = staging / PAYLOAD
            if not payload.exists() and not payload.is_symlink():
                raise GuestError(f"copy_out: the guest sent nothing for {src}")
            if target.exists() and target.is_dir() and payload.is_dir():
                rmtree(target)  # a guest's tree: any depth (shutil.rmtree recursed once per level)
            elif target.exists() and target.is_dir():
                raise GuestError(f"copy_out: {target} is a directory but {src} is not")
            os.replace(payload, target)
        finally:
            with contextlib.suppress(OSError):
                rmtree(staging)
        return target

    def _user(self) -> str | None:
        return None if self.user is None else str(self.user)

    def retire(self) -> None:
        """For the guest's owner (the pool), as it hands the guest to its teardown: every later
        exec, file operation or branch through this handle is refused, not sent to a guest that
        is being destroyed (closed means closed; logs and the transcript stay readable)."""
        self._retired = True

    def _check_live(self, what: str) -> None:
        if self._retired:
            raise ClosedError(f"{what}: guest {self.name} is destroyed (its test or session ended, or its owner "
                              "destroyed it): this handle takes no more calls")

    def _guest_path(self, path: str, what: str) -> str:
        """``path`` as the guest sees it: a relative one is taken from :attr:`workdir`."""
        self._check_live(what)
        if not isinstance(path, str) or not path or "\0" in path:  # a NUL: else the guest's own error, as a GuestError
            raise ValueError(f"{what}: guest path must be a non-empty string without a NUL byte, got {path!r}")
        return path if path.startswith("/") else posixpath.join(self.workdir, path)

    # ------------------------------------------------------------------ logs

    def logs(self) -> str:
        """The guest's own logs so far, followed by the exec transcript."""
        parts = []
        guest_logs = self._guest.logs()
        if guest_logs:
            parts.append(guest_logs.rstrip("\n"))
        parts.append(self.transcript_text())
        return "\n".join(parts)

    def transcript_text(self) -> str:
        if not self.transcript:
            return "(no commands were run in this guest)"
        return "\n".join(entry.render() for entry in self.transcript)


def _host_path(value: object, what: str) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a host path (str or os.PathLike), got {value!r}")
    return Path(value)


def _as_bytes(value: object, what: str) -> bytes:
    """``value`` as bytes (text UTF-8 encoded); anything else, an int above all (``bytes(5)`` is
    five NULs), is a one-line TypeError naming the argument."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} must be str or bytes, got {type(value).__name__}")


def batch_size(n: object) -> int:
    """``n`` as a batch size, or a one-line TypeError (not an int) or ValueError naming the argument."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"vm.branch_batch: n must be an integer from 1 to {MAX_BRANCHES}, got {n!r}")
    if not 1 <= n <= MAX_BRANCHES:
        raise ValueError(f"vm.branch_batch: n must be an integer from 1 to {MAX_BRANCHES}, got {n!r}")
    return n


def brancher_of(handle: GuestHandle) -> Brancher:
    handle._check_live("vm.branch")
    if handle._brancher is None:
        raise UsageError(f"vm.branch: guest {handle.name} has no owner that can branch it (a handle made "
                         "outside smol_vm, smol_vm_factory and Session)")
    return handle._brancher


@functools.cache
def _host_gnu_tar() -> str | None:
    """The host's GNU tar, if any: much faster than tarfile per member on the trees tests copy."""
    path = shutil.which("tar")
    if path is None:
        return None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path if "GNU tar" in version else None


def _tar_with_gnu_tar(source: Path, out: IO[bytes]) -> bool:
    """Write ``source``'s tree as a tar to ``out`` with GNU tar; False if it could not start."""
    tar = _host_gnu_tar()
    assert tar is not None
    try:
        out.flush()
        proc = subprocess.run(
            [tar, "-c", "-f", "-", "--format=gnu", "--numeric-owner", "--owner=0", "--group=0",
             "-C", str(source), "."],
            stdout=out.fileno(), stderr=subprocess.PIPE, check=False)
    except OSError:
        return False
    if proc.returncode != 0:
        detail = proc.stderr.decode(errors="replace").strip().splitlines()
        raise GuestError(f"copy_in: tar of {source} failed: {detail[-1] if detail else proc.returncode}")
    return True


def _owned_by_guest_root(member: tarfile.TarInfo) -> tarfile.TarInfo:
    # Host uids mean nothing in the guest (and are unmapped in a user namespace, where a
    # failed chown would also skip the chmod): copied-in files belong to the guest's root.
    return member.replace(uid=0, gid=0, uname="root", gname="root", deep=False)


def _positive_limit(value: float, what: str, name: str = "max_bytes") -> float:
    """A byte cap or a timeout as given, or a one-line ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what}: {name} must be a positive number, got {value!r}")
    return value
