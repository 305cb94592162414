"""A smol machine as a Guest: exec, files, archives, logs, keep and delete through the SDK.

``import smol`` mutates ``os.environ`` (it ``setdefault``s ``SMOLVM_SECCOMP`` and
``SMOLVM_LANDLOCK``), so this module imports it only inside functions. Every SDK call passes
``ConnectOptions(target=...)`` explicitly, because the SDK's own default silently switches to
the (billed) cloud when ``SMOL_CLOUD_TOKEN`` is set.

How a command runs is :mod:`.exec_plumbing`'s; this class is the rest of the guest.

SDK behaviour the public API does not promise is used only through ``smol_sdk.py``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import posixpath
import re
import tarfile
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import IO, TYPE_CHECKING, Any

from pytest_smolvm import limits
from pytest_smolvm.backends.base import EgressAttempt
from pytest_smolvm.backends.smol import handle as smol_handle
from pytest_smolvm.backends.smol.common import _connect, _describe, _is_gone
from pytest_smolvm.backends.smol.exec_plumbing import SCRATCH, ExecPlumbing
from pytest_smolvm.backends.smol.reap import destroy_recorded
from pytest_smolvm.backends.smol.sdk import remove_fork_lock, vm_data_dir
from pytest_smolvm.backends.smol.streamed_read import (
    NO_WRAP,
    GuestBytes,
    OverCap,
    StreamFailed,
    pour_to_reader,
    read_capped,
)
from pytest_smolvm.errors import GuestError
from pytest_smolvm.untrusted import rules

if TYPE_CHECKING:
    from smol import Machine

# $2 as base64 after one header line (streamed_read): "dir" (a tar of it, staged in file $1 and
# made whole before the header, so a tar that fails says so before anything is sent), "file
# MODE SIZE" (its bytes, opened before the header), "link" (its target) or "other".
ARCHIVE_SCRIPT = NO_WRAP + r"""
s=$1 p=$2
if [ -d "$p" ] && [ ! -L "$p" ]; then
  cd "$p" || exit 1
  if ! e=$(tar -cf "$s" . 2>&1); then
    rm -f -- "$s"; echo "$e" | tail -n 3 >&2
    case "$e" in *"Permission denied"*) echo "Permission denied" >&2; exit 13;; esac; exit 1
  fi
  echo dir; base64 $w <"$s"; rc=$?; rm -f -- "$s"; exit $rc
elif [ -L "$p" ]; then echo link; printf %s "$(readlink -- "$p")" | base64 $w
elif [ -f "$p" ]; then exec <"$p" || exit 1; echo "file $(stat -c '%a %s' -- "$p")"; exec base64 $w
elif [ -e "$p" ]; then echo other
else echo "No such file or directory" >&2; exit 2; fi
"""
# $3 parts of the archive, files "$2.0" .. "$2.N-1", into directory $1; each part goes once read.
UNPACK_SCRIPT = r"""
mkdir -p -- "$1" || exit 1
i=0
while [ "$i" -lt "$3" ]; do cat -- "$2.$i" || exit 1; rm -f -- "$2.$i"; i=$((i + 1)); done | tar -xf - -C "$1"
"""
UPLOAD_PART = 64 << 20
LOG_FILES = ("agent-startup-error.log", "agent-console.log", "vmm-exit.json", "workload.log")
LOG_TAIL_BYTES = 64 << 10


class SmolGuest(ExecPlumbing):
    """One live machine. ``owned=False`` for a source handed out to run baseline setup in."""

    def __init__(self, machine: Machine, *, name: str, target: str, source: str | None,
                 env: Mapping[str, str], owned: bool = True,
                 on_release: Callable[[SmolGuest, bool], None] | None = None, branchable: bool = False) -> None:
        self.name = name
        self._machine = machine
        self._target = target
        self._source = source
        self._env = dict(env)
        self._owned = owned
        self._on_release = on_release  # tells the backend this guest is gone (False) or kept (True)
        self.kept = False
        self._lock = threading.Lock()
        self._free_scratch: list[str] = []  # exec plumbing file prefixes no call is using (list ops are atomic)
        self._destroyed = False
        self._captured_logs: str | None = None
        self.branchable = branchable  # started branchable=True (the smol marker's branchable): vm.branch works
        self.branches: list[SmolGuest] = []  # its live children (vm.branch): the engine deletes them first

    @property
    def machine_id(self) -> str:
        return self._machine.id

    def _sh(self, script: str, *args: str, what: str, user: str | None = None) -> None:
        """Run a plumbing shell snippet; raise GuestError with its stderr when it fails."""
        from smol import SmolError

        try:
            result = self._raw_exec(["/bin/sh", "-c", script, "pytest-smolvm", *args], env={},
                                    workdir=None, timeout=limits.LIMITS.smol_plumbing, user=user)
        except SmolError as exc:
            raise GuestError(f"{what} in {self.name}: {_describe(exc)}") from exc
        if result.exit_code != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise GuestError(f"{what} in {self.name}: {detail[-1] if detail else f'exit {result.exit_code}'}")

    # ---------------------------------------------------------------- files

    def write_file(self, path: str, data: bytes, mode: int | None, *, user: str | None = None) -> None:
        if user is not None:
            user, _home = smol_handle.resolve_user(self._machine, user, self.name)
            smol_handle.write_as(self._raw_exec, path, data, mode, user=user, name=self.name)
            return
        parent = posixpath.dirname(path)
        try:
            if parent not in ("", "/"):
                # The SDK's write_file does not create parent directories.
                self._sh('mkdir -p -- "$1"', parent, what=f"write_file {path}: mkdir")
            self._sdk_write(path, data, mode)
        except GuestError as exc:
            raise smol_handle.classify(self._raw_exec, path, "write", None) or exc from None

    def read_file(self, path: str, *, max_bytes: int | None = None, user: str | None = None) -> bytes:
        if user is not None:
            user, _home = smol_handle.resolve_user(self._machine, user, self.name)
        try:
            data, longer = read_capped(self._machine, path, (1 << 62) if max_bytes is None else max_bytes,
                                       name=self.name, what=f"read_file {path}", user=user,
                                       timeout=limits.LIMITS.smol_plumbing)
        except GuestError as exc:
            raise smol_handle.classify(self._raw_exec, path, "read", user) or exc from None
        if longer:
            raise OSError(errno.EFBIG, f"File too large: over read_file's max_bytes={max_bytes}", path)
        return data

    def put_archive(self, guest_dir: str, produce: Callable[[IO[bytes]], None], *,
                    user: str | None = None) -> None:
        """The host's archive, staged in the guest in parts of UPLOAD_PART (one SDK transfer
        carries at most 100 MiB on the cloud; the host holds one part at a time), then fed
        to the guest's tar, as ``user``, each part removed once read."""
        if user is not None:
            user, _home = smol_handle.resolve_user(self._machine, user, self.name)
        staged = f"{SCRATCH}-{uuid.uuid4().hex[:12]}.tar"
        unpacked = False
        try:
            with tempfile.TemporaryFile() as spool:
                produce(spool)
                spool.seek(0)
                parts = 0
                while part := spool.read(UPLOAD_PART):
                    self._sdk_write(f"{staged}.{parts}", part, 0o600 if user is None else 0o644)  # user's tar reads it
                    parts += 1
            self._sh(UNPACK_SCRIPT, guest_dir, staged, str(parts), what=f"copy_in to {guest_dir}", user=user)
            unpacked = True
        except GuestError as exc:
            raise smol_handle.classify(self._raw_exec, guest_dir, "into", user) or exc from None
        finally:
            if user is not None or not unpacked:
                # What a user could not remove from root's /tmp, or what a failure left behind.
                with contextlib.suppress(GuestError):
                    self._sh('rm -f -- "$1".*', staged, what="copy_in cleanup")

    def get_archive(self, guest_path: str, arcname: str, consume: Callable[[IO[bytes]], None], *,
                    user: str | None = None) -> None:
        """The guest's own tar of a directory, named relative to it (``./...``), which the host's
        extractor places under ``arcname`` itself; a single file comes as one member the host
        frames. Either way the bytes reach ``consume`` as they arrive, bounded, and no host-side
        pass parses the guest's stream before hostfs does."""
        if user is not None:
            user, _home = smol_handle.resolve_user(self._machine, user, self.name)
        staged = f"{SCRATCH}-{uuid.uuid4().hex[:12]}.tar"
        try:
            with GuestBytes(self._machine, ARCHIVE_SCRIPT, [staged, posixpath.normpath(guest_path)],
                            name=self.name, what=f"copy_out of {guest_path}", user=user,
                            timeout=limits.LIMITS.smol_plumbing) as answer:
                try:
                    header = answer.header()
                except StreamFailed as exc:
                    refused = smol_handle.classify(self._raw_exec, guest_path, "tree", user)
                    if refused is None and "Permission denied" in exc.stderr:
                        refused = PermissionError(errno.EACCES, os.strerror(errno.EACCES), guest_path)
                    raise refused or exc from None
                _send_archive(answer, header, arcname, consume)
        except BaseException:
            with contextlib.suppress(GuestError):  # a tree's staged tar, where its script did not get to it
                self._sh('rm -f -- "$1"', staged, what="copy_out cleanup")
            raise

    # ---------------------------------------------------------------- logs and lifetime

    def egress(self) -> list[EgressAttempt]:
        return []  # the SDK reports no connection ledger

    def logs(self) -> str:
        if self._captured_logs is not None:
            return self._captured_logs
        return self._collect_logs()

    def _collect_logs(self) -> str:
        if self._target == "cloud":
            from smol import SmolError

            try:
                return self._machine.logs(200)
            except SmolError as exc:
                return f"(smol cloud logs unavailable: {_describe(exc)})"
        return read_local_logs(self.name)

    def keep(self) -> None:
        """Leave this guest alone at teardown (and so its source, which cannot go before it).

        A local branch is still stopped by the SDK when this process exits: the engine ties a
        non-detached machine to its process, and detach cannot be turned on after creation.
        """
        if self._owned and not self.kept:
            self.kept = True
            if self._on_release is not None:
                self._on_release(self, True)

    def registry_data(self) -> dict[str, Any]:
        return {"name": self.name, "id": self._machine.id, "target": self._target, "source": self._source}

    def destroy(self) -> None:
        """Delete the machine. Only a delete that succeeded (or found it gone) counts: after a
        failed one the guest stays this backend's to retry, and ``close()`` tries again."""
        if self._destroyed:
            return
        if not self._owned:
            self._destroyed = True
            return  # a source: the backend deletes it after its children
        if self._captured_logs is None:
            try:
                # The engine deletes the logs with the machine.
                self._captured_logs = self._collect_logs()
            except Exception as exc:  # logs must never stop a delete
                self._captured_logs = f"(logs could not be read before delete: {exc})"
        for child in list(self.branches):  # "the branch source of N live machines; delete them first"
            child.destroy()
        delete_machine(self._machine, self.name, self._target)
        self._destroyed = True
        if self._on_release is not None:
            self._on_release(self, False)


def delete_machine(machine: Machine, name: str, target: str) -> None:
    from smol import SmolError

    try:
        machine.delete()
    except SmolError as exc:
        if not _is_gone(exc):
            raise GuestError(f"could not delete smol machine {name}: {_describe(exc)}") from exc
    if target == "local":
        remove_fork_lock(name)


def delete_named(names: list[str], target: str) -> None:
    """Delete whichever machines of these names exist (listed: the cloud deletes by id, not name).
    Best effort, never raising: it cleans up after a failed call, whose error is the one to report,
    and what it misses the backend's close finds by label."""
    from smol import Machine

    wanted = set(names)
    with contextlib.suppress(Exception):
        for summary in Machine.list(_connect(target)):
            if summary.name in wanted:
                with contextlib.suppress(Exception):
                    destroy_recorded({"target": target, "id": summary.id, "name": summary.name})


def read_local_logs(name: str, tail_bytes: int = LOG_TAIL_BYTES) -> str:
    """The engine's per-machine log files, tails only (readable only until the machine is deleted)."""
    directory = vm_data_dir(name)
    parts: list[str] = []
    for log in LOG_FILES:
        path = directory / log
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - tail_bytes))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        if text.strip():
            cut = " (tail)" if size > tail_bytes else ""
            parts.append(f"--- {log}{cut}\n{text.rstrip()}")
    return "\n".join(parts)


def _send_archive(answer: GuestBytes, header: str, arcname: str, consume: Callable[[IO[bytes]], None]) -> None:
    """What ARCHIVE_SCRIPT's ``header`` announces, as a tar ``consume`` reads."""
    kind, _, detail = header.partition(" ")
    file = re.fullmatch(r"([0-7]{1,6}) ([0-9]{1,20})", detail)
    if kind == "dir" and not detail:
        caps = rules.Caps()  # hostfs holds the call's own caps; this bounds the transfer itself
        pour_to_reader(answer, consume, limit=caps.max_bytes + rules.HEADER_ALLOWANCE * caps.max_members)
    elif kind == "file" and file is not None:
        mode, size = int(file.group(1), 8), int(file.group(2))
        if size > limits.LIMITS.copy_out_bytes:
            raise GuestError(f"{answer.what}: more than {limits.LIMITS.copy_out_bytes} bytes (the cap); refused")
        info = tarfile.TarInfo(arcname)
        info.size, info.mode = size, mode & 0o7777
        end = b"\0" * (-size % tarfile.BLOCKSIZE + 2 * tarfile.BLOCKSIZE)  # padding, then the end blocks
        pour_to_reader(answer, consume, limit=size, expect=size, suffix=end,
                       prefix=info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
    elif kind == "link" and not detail:
        target = io.BytesIO()
        try:
            answer.pour(target.write, rules.MAX_NAME)
        except OverCap:
            raise GuestError(f"{answer.what}: a link target over {rules.MAX_NAME} bytes") from None
        info = tarfile.TarInfo(arcname)
        info.type, info.linkname = tarfile.SYMTYPE, target.getvalue().decode("utf-8", "surrogateescape")
        consume(io.BytesIO(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + b"\0" * 2 * tarfile.BLOCKSIZE))
    elif kind == "other" and not detail:
        raise GuestError(f"{answer.what}: not a regular file, directory or symlink")
    else:
        raise GuestError(f"{answer.what}: the guest answered {header[:80]!r}, not what was asked")
