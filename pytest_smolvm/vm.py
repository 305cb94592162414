"""The VM handle tests use, and ExecResult. Backend-agnostic: all guest I/O goes through a Guest."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from pytest_smolvm import hostfs
from pytest_smolvm.errors import ExecError, GuestError

if TYPE_CHECKING:
    from pytest_smolvm.backends import Guest

DEFAULT_OUTPUT_LIMIT = 16 << 20  # per stream; beyond it the middle is dropped with a marker
DEFAULT_READ_LIMIT = 256 << 20  # read_file: more is an error (use copy_out for big files)
TRANSCRIPT_TAIL = 2000
PAYLOAD = "payload"


def _tail(text: str, limit: int = TRANSCRIPT_TAIL) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} chars]\n" + text[-limit:]


@dataclass(frozen=True)
class ExecResult:
    """What one ``exec`` produced. ``stdout``/``stderr`` are text (undecodable bytes replaced)."""

    command: str
    exit_code: int
    stdout: str
    stderr: str
    duration: float
    timed_out: bool = False
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> ExecResult:
        """Raise :class:`ExecError` unless the command exited 0 in time; returns self."""
        if not self.ok:
            what = "timed out" if self.timed_out else f"exited {self.exit_code}"
            raise ExecError(
                f"guest command {what}: {self.command}\n"
                f"--- stdout (tail)\n{_tail(self.stdout)}\n--- stderr (tail)\n{_tail(self.stderr)}",
                self)
        return self


@dataclass
class TranscriptEntry:
    command: str
    exit_code: int | None
    duration: float
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    error: str = ""

    def render(self) -> str:
        status = ("TIMED OUT" if self.timed_out else f"exit {self.exit_code}"
                  if self.exit_code is not None else f"error: {self.error}")
        lines = [f"$ {self.command}    [{status}, {self.duration:.3f}s]"]
        for label, text in (("stdout", self.stdout), ("stderr", self.stderr)):
            if text:
                lines.append(f"  --- {label} (tail)")
                lines.extend("  " + line for line in _tail(text).splitlines())
        return "\n".join(lines)


class VM:
    """A fresh guest for one test. Every method talks to that guest only."""

    def __init__(self, guest: Guest, *, default_timeout: float | None = None,
                 backend: str = "", isolation: str = "", baseline: str = "", digest: str = "") -> None:
        self._guest = guest
        self.default_timeout = default_timeout
        self.backend = backend
        self.isolation = isolation
        self.baseline = baseline
        self.digest = digest
        self.transcript: list[TranscriptEntry] = []

    @property
    def name(self) -> str:
        return self._guest.name

    def __repr__(self) -> str:
        return f"<VM {self.name} backend={self.backend}>"

    # ------------------------------------------------------------------ exec

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
             env: Mapping[str, str] | None = None, workdir: str | None = None,
             stdin: str | bytes | None = None, check: bool = False) -> ExecResult:
        """Run ``cmd`` in the guest: a string through ``/bin/sh -c``, a list as argv.

        ``timeout`` (seconds, default: the marker's ``timeout``) kills the command's process
        group in the guest and returns ``timed_out=True``; the test process is untouched.
        """
        if isinstance(cmd, str):
            argv, shown = ["/bin/sh", "-c", cmd], cmd
        else:
            argv = [os.fspath(a) for a in cmd]
            if not argv:
                raise ValueError("exec: cmd is an empty list")
            shown = " ".join(argv)
        if timeout is None:
            timeout = self.default_timeout
        if timeout is not None and timeout <= 0:
            raise ValueError(f"exec: timeout must be positive, got {timeout}")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        started = time.monotonic()
        try:
            raw = self._guest.exec(argv, env=dict(env or {}), workdir=workdir, stdin=data,
                                   timeout=timeout, output_limit=DEFAULT_OUTPUT_LIMIT)
        except Exception as exc:
            self.transcript.append(TranscriptEntry(shown, None, time.monotonic() - started, error=str(exc)))
            raise
        result = ExecResult(shown, raw.exit_code, raw.stdout.decode("utf-8", "replace"),
                            raw.stderr.decode("utf-8", "replace"), time.monotonic() - started,
                            raw.timed_out, raw.stdout, raw.stderr)
        self.transcript.append(TranscriptEntry(shown, result.exit_code, result.duration,
                                               _tail(result.stdout), _tail(result.stderr), result.timed_out))
        return result.check() if check else result

    # ------------------------------------------------------------------ files

    def write_file(self, path: str, data: str | bytes, *, mode: int | None = None) -> None:
        """Write ``data`` (text is UTF-8 encoded) to ``path`` in the guest, creating parent dirs."""
        _require_absolute(path, "write_file")
        self._guest.write_file(path, data.encode() if isinstance(data, str) else bytes(data), mode)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The bytes of the regular file ``path`` in the guest (a symlink to one is followed there).

        The guest controls the file: FIFOs and devices are refused, and more than ``max_bytes``
        (default :data:`DEFAULT_READ_LIMIT`) is an error, checked while reading.
        """
        _require_absolute(path, "read_file")
        limit = DEFAULT_READ_LIMIT if max_bytes is None else int(_positive_limit(max_bytes, "read_file"))
        data = self._guest.read_file(path) if max_bytes is None else \
            self._guest.read_file(path, max_bytes=limit)  # type: ignore[call-arg]
        if len(data) > limit:  # a backend that cannot stop early: the cap still holds for the caller
            raise GuestError(f"read_file {path}: more than {limit} bytes (max_bytes); refused")
        return data

    def copy_in(self, src: str | os.PathLike[str], dest: str) -> None:
        """Copy a host file or tree to ``dest`` in the guest (modes kept, links copied as links)."""
        _require_absolute(dest, "copy_in")
        source = Path(src)
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

        self._guest.put_archive(target_dir, produce)

    def copy_out(self, src: str, dest: str | os.PathLike[str], *, max_bytes: int | None = None,
                 timeout: float | None = None) -> Path:
        """Copy a guest file or tree to ``dest`` on the host; returns ``dest``.

        The guest controls what arrives, so it is unpacked by :mod:`pytest_smolvm.hostfs`'s
        rules: nothing is written outside ``dest``, no guest-made link is followed, links that
        point outside the copied tree, devices and FIFOs are refused, and at most ``max_bytes``
        (default 4 GiB) arrive within ``timeout`` seconds (default 900).
        """
        _require_absolute(src, "copy_out")
        defaults = hostfs.Caps()
        caps = hostfs.Caps(
            max_bytes=defaults.max_bytes if max_bytes is None else int(_positive_limit(max_bytes, "copy_out")),
            timeout=defaults.timeout if timeout is None else _positive_limit(timeout, "copy_out", "timeout"))
        target = Path(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            raise GuestError(f"copy_out: destination {target} is a symlink; refusing to write through it")
        staging = Path(tempfile.mkdtemp(prefix=".smolvm-copy-", dir=target.parent))
        try:
            def consume(stream: IO[bytes]) -> None:
                hostfs.extract(stream, staging, hostfs.Policy(f"copy_out of {src}", prefix=PAYLOAD), caps)

            self._guest.get_archive(src, PAYLOAD, consume)
            payload = staging / PAYLOAD
            if not payload.exists() and not payload.is_symlink():
                raise GuestError(f"copy_out: the guest sent nothing for {src}")
            if target.exists() and target.is_dir() and payload.is_dir():
                shutil.rmtree(target)
            elif target.exists() and target.is_dir():
                raise GuestError(f"copy_out: {target} is a directory but {src} is not")
            os.replace(payload, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

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


@functools.cache
def _host_gnu_tar() -> str | None:
    """The host's GNU tar, if any: ~10x faster than tarfile per member on the trees tests copy."""
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


def _require_absolute(path: str, what: str) -> None:
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"{what}: guest path must be absolute, got {path!r}")
