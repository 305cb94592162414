"""The smol backend: every guest is a copy-on-write branch of a warm smolmachines microVM.

A *source* is a running, branchable machine booted once from the baseline (one per distinct
image + resources + network + env); each test's guest is ``source.branch(name)``. A source
cannot be deleted while it has children, so children always go first.

``import smol`` mutates ``os.environ`` (it ``setdefault``s ``SMOLVM_SECCOMP`` and
``SMOLVM_LANDLOCK``), so this module imports it only inside functions: importing this module
is cheap and changes nothing. Every SDK call passes ``ConnectOptions(target=...)``
explicitly, because the SDK's own default silently switches to the (billed) cloud when
``SMOL_CLOUD_TOKEN`` is set, and ``Machine.list`` with no options always lists the cloud.

Exec output: on the cloud one SDK call carries it byte-exact (``ExecOptions(output="b64")``,
the ``?output=b64`` query; transport.py:1231-1259). The local SDK hands output back already
decoded as lossy UTF-8 text (transport.py:772-778) and has no byte-exact form, so there each
command's stdout/stderr go to files in the guest, trimmed there and read back with
``read_file``. That also means a background process that keeps the command's stdout open
can never hold a local exec open.

SDK behaviour the public API does not promise is used only through ``smol_sdk.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import posixpath
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, ClassVar

from pytest_smolvm.backends import BackendOptions, Cancel, Guest, GuestExecResult, OutputCallback, VMSpec, smol_handle
from pytest_smolvm.backends.output import bounded
from pytest_smolvm.errors import GuestError, ProvisionError, UsageError
from pytest_smolvm.paths import state_dir
from pytest_smolvm.probe import ProbeResult
from pytest_smolvm.procs import host_identity, is_alive, process_start_time
from pytest_smolvm.smol_sdk import exec_cancellable, remove_fork_lock, vm_data_dir

if TYPE_CHECKING:
    from smol import ConnectOptions, Machine, MachineConfig, SmolError

    from pytest_smolvm.baseline import Baseline

TARGETS = ("local", "cloud")
IMAGE_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # what the engine recognises as a local archive
LABEL = "pytest-smolvm"
SOURCE_LABEL = "pytest-smolvm-source"  # children inherit their source's labels: finds them by source
SOURCE_PREFIX = "pytest-smolvm-src-"
DERIVED = " + setup"  # ends a warm baseline's reference; never part of an image reference (no spaces)
GONE_CODES = frozenset({"NOT_FOUND", "VM_NOT_FOUND"})
TIMEOUT_CODES = frozenset({"TIMEOUT", "CANCELLED", "INTERRUPTED"})
# Worth another provisioning attempt whatever the server's ``retryable`` flag says: the request
# never got an answer (CONNECTION, TIMEOUT), or the machine was cut off under it.
RETRYABLE_CODES = frozenset({"CONNECTION", "NETWORK_ERROR", "TIMEOUT", "MACHINE_INTERRUPTED"})
TIMEOUT_EXIT = 124
KILLED_EXITS = frozenset({TIMEOUT_EXIT, 128 + 9, 128 + 15, -9, -15})
DEFAULT_CPUS = 1
DEFAULT_MEMORY_MB = 512  # the engine's default (4 vCPU / 8 GiB per VM) trips branch memory admission
DEFAULT_TTL_SECONDS = 3600
DEFAULT_READY_TIMEOUT = 120.0
# The agent kills a timed-out command itself; this host-side backstop only fires if it does not.
EXEC_CANCEL_GRACE = 30.0
LOG_FILES = ("agent-startup-error.log", "agent-console.log", "vmm-exit.json", "workload.log")
LOG_TAIL_BYTES = 64 << 10
# mkdir/tar/rm for file transfers: generous for big trees, but a wedged guest must not hang a test.
PLUMBING_TIMEOUT = 600.0
SCRATCH = "/tmp/.pytest-smolvm"  # per-guest exec plumbing files (one exec at a time per guest)

# Runs the command with its output in files. Arguments: mode (run|trim), file prefix, output
# limit, stdin file ("" for none), then argv. "trim" only shortens files a timed-out "run" left.
# Oversized output keeps its head and tail; the dropped byte counts are printed for the host.
_EXEC_SCRIPT = r"""
mode=$1 p=$2 l=$3 i=$4; shift 4
trim() {
  s=$(( $(wc -c <"$1" 2>/dev/null || echo 0) ))
  if [ "$s" -gt "$l" ]; then
    h=$((l / 2))
    { head -c "$h" "$1"; tail -c "$h" "$1"; } >"$1.t" && mv -f "$1.t" "$1"
    printf ' %s' $((s - 2 * h))
  else
    printf ' 0'
  fi
}
rc=0
if [ "$mode" = run ]; then
  rm -f "$p.out" "$p.err"
  "$@" <"${i:-/dev/null}" >"$p.out" 2>"$p.err"
  rc=$?
fi
[ -n "$i" ] && rm -f "$i"
trim "$p.out"; trim "$p.err"
exit $rc
"""


def cloud_token_source() -> str | None:
    """Where a smol cloud API key would come from, without reading it out: env var or CLI config."""
    if os.environ.get("SMOL_CLOUD_TOKEN"):
        return "SMOL_CLOUD_TOKEN"
    homes = [os.path.join(os.path.expanduser("~"), ".config")]
    if os.environ.get("XDG_CONFIG_HOME"):
        homes.insert(0, os.environ["XDG_CONFIG_HOME"])
    for home in homes:
        path = os.path.join(home, "smolvm", "config.toml")
        if _config_has_api_key(path):
            return path
    return None


def _config_has_api_key(path: str) -> bool:
    """Whether ``[cloud] api_key`` is set in the CLI config (a line scan: tomllib is 3.11+)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    in_cloud = False
    for raw in lines:
        line = raw.strip()
        if line.startswith("["):
            in_cloud = line == "[cloud]"
        elif in_cloud and line.startswith("api_key"):
            key, _, value = line.partition("=")
            if key.strip() == "api_key" and value.strip().strip("\"'"):
                return True
    return False


def _smol_version() -> str:
    from pytest_smolvm.probe import smolmachines_version

    return smolmachines_version() or "not installed"


def _connect(target: str) -> ConnectOptions:
    from smol import ConnectOptions

    return ConnectOptions(target="cloud" if target == "cloud" else "local")


def _describe(exc: SmolError) -> str:
    return f"[{exc.code}] {exc.message}"


def _is_gone(exc: SmolError) -> bool:
    return exc.code in GONE_CODES or "not found" in exc.message.lower()


def is_retryable(exc: SmolError) -> bool:
    """Whether a failed provisioning call is worth repeating (with a new name).

    The cloud says so itself: ``SmolError.retryable`` comes from the problem body's
    ``retryable`` or, failing that, from 408/429/502/503/504 (transport.py:1944-1973).
    """
    return bool(getattr(exc, "retryable", False)) or exc.code in RETRYABLE_CODES


def provision_error(message: str, exc: SmolError) -> ProvisionError:
    return ProvisionError(f"{message}: {_describe(exc)}", retryable=is_retryable(exc))


@dataclass(frozen=True)
class OwnedMachine:
    """A machine this plugin made, as ``Machine.list`` reports it (for the reaper)."""

    name: str
    state: str
    labels: Mapping[str, str]
    is_source: bool


class SmolGuest:
    """One live machine. ``owned=False`` for a source handed out to run baseline setup in."""

    def __init__(self, machine: Machine, *, name: str, target: str, source: str | None,
                 env: Mapping[str, str], owned: bool = True,
                 on_release: Callable[[SmolGuest, bool], None] | None = None) -> None:
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

    @property
    def machine_id(self) -> str:
        return self._machine.id

    # ---------------------------------------------------------------- exec

    def exec(self, argv: Sequence[str], *, env: Mapping[str, str], workdir: str | None,
             stdin: bytes | None, timeout: float | None, output_limit: int, user: str | None = None,
             on_output: OutputCallback | None = None, cancel: Cancel | None = None) -> GuestExecResult:
        smol_handle.check_arg_size(argv, {**self._env, **env})
        try:
            result = self._exec_any(argv, env=env, workdir=workdir, stdin=stdin, timeout=timeout,
                                    output_limit=output_limit, user=user, on_output=on_output, cancel=cancel)
        except GuestError as exc:
            # The engine reports a workdir it cannot enter as a failed exec: say which.
            refused = smol_handle.classify(self._raw_exec, workdir, "dir", user) if workdir else None
            raise refused or exc from None
        if result.exit_code in (126, 127) and not result.timed_out and not result.cancelled:
            # Like subprocess: an argv whose program is missing or not executable raises. A
            # shell string's argv[0] is /bin/sh, which is there: its 127/126 stay.
            refused = smol_handle.program_error(self._raw_exec, argv[0], env={**self._env, **env},
                                                workdir=workdir, user=user)
            if refused is not None:
                raise refused
        return result

    def _exec_any(self, argv: Sequence[str], *, env: Mapping[str, str], workdir: str | None,
                  stdin: bytes | None, timeout: float | None, output_limit: int, user: str | None,
                  on_output: OutputCallback | None, cancel: Cancel | None) -> GuestExecResult:
        if user is not None or on_output is not None or cancel is not None:
            full_env = {**self._env, **env}
            if user is not None:
                user, home = smol_handle.resolve_user(self._machine, user, self.name)
                full_env = smol_handle.user_env(full_env, {*self._env, *env}, user, home)
            result = smol_handle.stream_exec(
                self._machine, self._raw_exec, argv, name=self.name, env=full_env, workdir=workdir, stdin=stdin,
                timeout=timeout, output_limit=output_limit, user=user, on_output=on_output, cancel=cancel)
        elif self._target == "cloud":
            result = self._exec_cloud(list(argv), env=env, workdir=workdir, stdin=stdin, timeout=timeout,
                                      output_limit=output_limit)
        else:
            scratch = self._take_scratch()  # calls from several threads each have their own files
            try:
                result = self._exec_locked(list(argv), env=env, workdir=workdir, stdin=stdin,
                                           timeout=timeout, output_limit=output_limit, scratch=scratch)
            finally:
                self._free_scratch.append(scratch)
        return result

    def _take_scratch(self) -> str:
        try:
            return self._free_scratch.pop()
        except IndexError:
            return f"{SCRATCH}-{uuid.uuid4().hex[:12]}"

    def _exec_cloud(self, argv: list[str], *, env: Mapping[str, str], workdir: str | None,
                    stdin: bytes | None, timeout: float | None, output_limit: int) -> GuestExecResult:
        """One SDK call: byte-exact output as base64 (``?output=b64``), bounded here."""
        from smol import ExecOptions, SmolError

        text_stdin: str | None = None
        if stdin:
            try:
                text_stdin = stdin.decode("utf-8")  # the SDK carries stdin as text only
            except UnicodeDecodeError:
                # Binary stdin goes in as a file the command reads (and removes) first.
                staged = f"/tmp/.pytest-smolvm-stdin-{uuid.uuid4().hex[:12]}"
                self._sdk_write(staged, stdin, 0o600)
                argv = ["/bin/sh", "-c", 'exec <"$1" && rm -f -- "$1" && shift && exec "$@"', "sh", staged,
                        *argv]
        opts = ExecOptions(env={**self._env, **env} or None, workdir=workdir, timeout=timeout,
                           stdin=text_stdin, output="b64")
        started = time.monotonic()
        try:
            result = self._machine.exec(argv, opts)
        except SmolError as exc:
            if timeout is None or exc.code not in TIMEOUT_CODES:
                raise GuestError(f"exec in {self.name} failed: {_describe(exc)}") from exc
            return GuestExecResult(TIMEOUT_EXIT, b"", b"", True)
        elapsed = time.monotonic() - started
        # The agent reports its own kill as 124 (or as the signal); a command may exit 124 by
        # itself (`timeout(1)`), hence the clock.
        timed_out = timeout is not None and result.exit_code in KILLED_EXITS and elapsed >= timeout
        limit = max(int(output_limit), 2)
        return GuestExecResult(TIMEOUT_EXIT if timed_out else result.exit_code,
                               bounded(result.stdout_bytes, limit), bounded(result.stderr_bytes, limit),
                               timed_out)

    def _exec_locked(self, argv: list[str], *, env: Mapping[str, str], workdir: str | None,
                     stdin: bytes | None, timeout: float | None, output_limit: int,
                     scratch: str = SCRATCH) -> GuestExecResult:
        from smol import SmolError

        stdin_path = ""
        if stdin:
            stdin_path = f"{scratch}.in"
            self._sdk_write(stdin_path, stdin, None)
        limit = max(int(output_limit), 2)
        command = ["/bin/sh", "-c", _EXEC_SCRIPT, "pytest-smolvm", "run", scratch, str(limit), stdin_path,
                   *argv]
        started = time.monotonic()
        timed_out = False
        exit_code = TIMEOUT_EXIT
        report = ""
        try:
            result = self._raw_exec(command, env={**self._env, **env}, workdir=workdir, timeout=timeout)
        except SmolError as exc:
            if timeout is None or exc.code not in TIMEOUT_CODES:
                raise GuestError(f"exec in {self.name} failed: {_describe(exc)}") from exc
            timed_out = True
        else:
            elapsed = time.monotonic() - started
            exit_code = result.exit_code
            report = result.stdout
            # The agent reports its own kill as 124 (or as the signal); a command may exit 124 by
            # itself (`timeout(1)`), hence the clock.
            timed_out = timeout is not None and exit_code in KILLED_EXITS and elapsed >= timeout
        if timed_out:
            exit_code = TIMEOUT_EXIT
            # The killed wrapper never shortened its files: do it now so a chatty command that
            # ran until the deadline cannot send gigabytes back.
            try:
                trimmed = self._raw_exec(["/bin/sh", "-c", _EXEC_SCRIPT, "pytest-smolvm", "trim", scratch,
                                          str(limit), stdin_path], env={}, workdir=None, timeout=60)
                report = trimmed.stdout
            except SmolError:
                report = ""
        dropped = [int(x) for x in report.split() if x.isdigit()][-2:] or [0, 0]
        while len(dropped) < 2:
            dropped.append(0)
        stdout = self._read_output(f"{scratch}.out", limit, dropped[0], required=not timed_out)
        stderr = self._read_output(f"{scratch}.err", limit, dropped[1], required=False)
        truncated = tuple(stream for stream, lost in zip(("stdout", "stderr"), dropped[:2], strict=True) if lost)
        return GuestExecResult(exit_code, stdout, stderr, timed_out, truncated)

    def _raw_exec(self, command: list[str], *, env: Mapping[str, str], workdir: str | None,
                  timeout: float | None, user: str | None = None, stdin: str | None = None) -> Any:
        """One SDK exec, with a host-side cancel in case the guest agent never enforces the timeout."""
        from smol import ExecOptions

        opts = ExecOptions(env=dict(env) or None, workdir=workdir, timeout=timeout, user=user, stdin=stdin)
        if timeout is None:
            return self._machine.exec(command, opts)
        canceller, run = exec_cancellable(self._machine, command, opts)
        if canceller is None or run is None:
            return self._machine.exec(command, opts)
        timer = threading.Timer(timeout + EXEC_CANCEL_GRACE, canceller.cancel)
        timer.daemon = True
        timer.start()
        try:
            return run()
        finally:
            timer.cancel()

    def _read_output(self, path: str, limit: int, dropped: int, *, required: bool) -> bytes:
        from smol import SmolError

        try:
            data = self._machine.read_file(path)
        except SmolError as exc:
            if required and not _is_gone(exc):
                raise GuestError(f"exec in {self.name}: could not read its output: {_describe(exc)}") from exc
            return b""
        return bounded(data, limit, dropped) if dropped else data

    def _sh(self, script: str, *args: str, what: str, user: str | None = None) -> None:
        """Run a plumbing shell snippet; raise GuestError with its stderr when it fails."""
        from smol import SmolError

        try:
            result = self._raw_exec(["/bin/sh", "-c", script, "pytest-smolvm", *args], env={},
                                    workdir=None, timeout=PLUMBING_TIMEOUT, user=user)
        except SmolError as exc:
            raise GuestError(f"{what} in {self.name}: {_describe(exc)}") from exc
        if result.exit_code != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise GuestError(f"{what} in {self.name}: {detail[-1] if detail else f'exit {result.exit_code}'}")

    # ---------------------------------------------------------------- files

    def _sdk_write(self, path: str, data: bytes, mode: int | None) -> None:
        from smol import SmolError

        try:
            self._machine.write_file(path, data, mode)
        except SmolError as exc:
            raise GuestError(f"write_file {path} in {self.name}: {_describe(exc)}") from exc

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
        from smol import SmolError

        if user is not None:
            user, _home = smol_handle.resolve_user(self._machine, user, self.name)
            return smol_handle.read_as(self._raw_exec, path, user=user, max_bytes=max_bytes, name=self.name)
        try:
            data = self._machine.read_file(path)
        except SmolError as exc:
            refused = smol_handle.classify(self._raw_exec, path, "read", None)
            raise refused or GuestError(f"read_file {path} in {self.name}: {_describe(exc)}") from exc
        if max_bytes is not None and len(data) > max_bytes:  # the SDK reads whole files: checked after
            raise OSError(errno.EFBIG, f"File too large: over read_file's max_bytes={max_bytes}", path)
        return data

    def put_archive(self, guest_dir: str, produce: Callable[[IO[bytes]], None], *,
                    user: str | None = None) -> None:
        with tempfile.TemporaryFile() as spool:
            produce(spool)
            spool.seek(0)
            data = spool.read()
        if user is not None:
            user, _home = smol_handle.resolve_user(self._machine, user, self.name)
        staged = f"{SCRATCH}-{uuid.uuid4().hex[:12]}.tar"
        self._sdk_write(staged, data, 0o600 if user is None else 0o644)  # the user's tar reads it
        try:
            self._sh('mkdir -p -- "$1" && tar -xf "$2" -C "$1"; rc=$?; rm -f "$2"; exit $rc',
                     guest_dir, staged, what=f"copy_in to {guest_dir}", user=user)
        except GuestError as exc:
            with contextlib.suppress(GuestError):
                self._sh('rm -f -- "$1"', staged, what="copy_in cleanup")
            raise smol_handle.classify(self._raw_exec, guest_dir, "write", user) or exc from None

    def get_archive(self, guest_path: str, arcname: str, consume: Callable[[IO[bytes]], None], *,
                    user: str | None = None) -> None:
        from smol import SmolError

        if user is not None:
            user, _home = smol_handle.resolve_user(self._machine, user, self.name)
        normalized = posixpath.normpath(guest_path)
        parent, base = posixpath.split(normalized)
        if not base:  # "/" itself
            parent, base = "/", "."
        staged = f"{SCRATCH}-{uuid.uuid4().hex[:12]}.tar"
        try:
            try:
                # A member the user may not read fails tar as a whole: exit 13 says so.
                self._sh('e=$(tar -cf "$1" -C "$2" -- "$3" 2>&1) && exit 0; echo "$e" | tail -n 3 >&2; '
                         'case "$e" in *"Permission denied"*) echo "Permission denied" >&2; exit 13;; esac; exit 1',
                         staged, parent or "/", base, what=f"copy_out of {guest_path}", user=user)
            except GuestError as exc:
                refused = smol_handle.classify(self._raw_exec, guest_path, "tree", user)
                if refused is None and "Permission denied" in str(exc):
                    refused = PermissionError(errno.EACCES, os.strerror(errno.EACCES), guest_path)
                raise refused or exc from None
            try:
                data = self._machine.read_file(staged)
            except SmolError as exc:
                raise GuestError(f"copy_out of {guest_path} in {self.name}: {_describe(exc)}") from exc
        finally:
            with contextlib.suppress(GuestError):
                self._sh('rm -f -- "$1"', staged, what="copy_out cleanup")
        # BusyBox tar cannot rename members, so the renaming to ``arcname`` happens here.
        with tempfile.TemporaryFile() as renamed:
            _rename_members(io.BytesIO(data), renamed, base, arcname)
            renamed.seek(0)
            consume(renamed)

    # ---------------------------------------------------------------- logs and lifetime

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


def _rename_members(source: IO[bytes], out: IO[bytes], base: str, arcname: str) -> None:
    """Copy a guest tar stream, renaming the top entry ``base`` to ``arcname``; content is untouched.

    Names that are not under ``base`` pass through unchanged for the consumer to refuse.
    """

    def rename(name: str) -> str:
        stripped = name[2:] if name.startswith("./") and base != "." else name
        if stripped == base:
            return arcname
        if stripped.startswith(base + "/"):
            return arcname + stripped[len(base):]
        return name

    try:
        with tarfile.open(fileobj=source, mode="r|") as tin, \
                tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tout:
            for member in tin:
                fileobj = tin.extractfile(member) if member.isreg() else None
                changes: dict[str, Any] = {"name": rename(member.name)}
                if member.islnk():
                    changes["linkname"] = rename(member.linkname)
                tout.addfile(member.replace(**changes, deep=False), fileobj)
    except tarfile.TarError as exc:
        raise GuestError(f"copy_out: the guest sent an unreadable archive: {exc}") from exc


# --------------------------------------------------------------------------- the backend


@dataclass
class _Source:
    key: str
    name: str  # local: the machine name; cloud: the machine id (what connect and delete take)
    machine: Machine | None
    owned: bool  # False: adopted from the process that outlives us; it deletes it


class SmolBackend:
    """Branches per-test guests from warm sources; deletes children before sources."""

    name: ClassVar[str] = "smol"
    isolation: ClassVar[str] = "microvm"

    def __init__(self, options: BackendOptions | None = None, *,
                 ttl_seconds: int | None = DEFAULT_TTL_SECONDS, cpus: int = DEFAULT_CPUS,
                 memory_mb: int = DEFAULT_MEMORY_MB, ready_timeout: float = DEFAULT_READY_TIMEOUT) -> None:
        options = options or BackendOptions()
        target, labels = options.target, options.labels
        if target not in TARGETS:
            raise UsageError(f"--smol-target={target}: choose local or cloud")
        if target == "cloud" and cloud_token_source() is None:
            raise UsageError("--smol-target=cloud needs a smol cloud API key: set SMOL_CLOUD_TOKEN "
                             "or log in with the smol CLI (smol auth login)")
        self.target = target
        # (pid, start time) identifies the owner even after its pid is reused: the reaper's test.
        self.labels = {LABEL: "1", "owner_pid": str(os.getpid()),
                       "owner_start": str(process_start_time(os.getpid())), "owner_host": host_identity(),
                       **dict(labels or {})}
        # derived baseline digest -> the setup that makes it, run in its source before any branch
        self._populate: dict[str, Callable[[SmolGuest], None]] = {}
        self.ttl_seconds = ttl_seconds if target == "cloud" else None  # the local engine ignores TTLs
        self.default_cpus = cpus
        self.default_memory_mb = memory_mb
        self.ready_timeout = ready_timeout
        self._sources: dict[str, _Source] = {}
        self._children: dict[str, SmolGuest] = {}
        self._kept_sources: set[str] = set()
        self._lock = threading.Lock()
        # Re-entrant: making a source runs the warm-baseline setup in it, which attaches to it.
        self._key_locks: dict[str, threading.RLock] = {}
        self._closed = False
        self._share_source = options.share_source  # set in xdist workers: the controller owns sources
        for key, name in options.shared.items():
            self._sources[key] = _Source(key, name, None, owned=False)

    # ---------------------------------------------------------------- protocol

    @classmethod
    def probe(cls) -> ProbeResult:
        from pytest_smolvm.probe import probe

        return probe()

    @classmethod
    def check_baseline(cls, baseline: Baseline, *, option: str = "--smol-baseline") -> None:
        """What the local engine cannot boot; cloud-only limits are checked when a source is made."""
        if baseline.kind == "image-archive" and baseline.path is not None \
                and not baseline.path.name.endswith(IMAGE_ARCHIVE_SUFFIXES):
            raise UsageError(f"{option}={baseline.reference}: smolmachines reads image archives "
                             f"as {', '.join(IMAGE_ARCHIVE_SUFFIXES)} only (not zstd)")

    @classmethod
    def describe_host(cls) -> list[str]:
        """Header lines: what a smol guest is."""
        return ["guests are copy-on-write branches of a warm microVM (own kernel; smolmachines "
                f"{_smol_version()})"]

    def prepare_run(self, baseline: Baseline) -> dict[str, str]:
        """Boot the default source here, in the process that outlives the workers that branch it."""
        self.source_guest(VMSpec(name="", baseline=baseline))
        return self.source_names()

    def share_source(self, spec: VMSpec) -> str:
        """A source a worker asked for: made and owned here, deleted at close after its children."""
        return self._source_for(spec, populate=False).name

    def create(self, spec: VMSpec) -> SmolGuest:
        from smol import SmolError

        if not spec.name:
            raise ProvisionError("smol: a guest needs a unique name (VMSpec.name is empty)")
        source = self._source_for(spec)
        machine = self._source_machine(source)
        try:
            child = machine.branch(spec.name)
        except SmolError as exc:
            raise provision_error(f"smol: could not branch {spec.name} from {source.name}", exc) from exc
        guest = SmolGuest(child, name=spec.name, target=self.target, source=source.name, env=spec.env,
                          on_release=self._release)
        with self._lock:
            self._children[spec.name] = guest
        return guest

    def _release(self, guest: SmolGuest, kept: bool) -> None:
        with self._lock:
            self._children.pop(guest.name, None)
            if kept and guest.registry_data()["source"]:
                self._kept_sources.add(str(guest.registry_data()["source"]))

    def destroy_recorded(self, data: Mapping[str, Any]) -> None:
        destroy_recorded(data)

    def close(self) -> None:
        """Delete this process's children, then the sources it owns (never adopted ones)."""
        errors: list[str] = []
        kept = kept_machines()  # kept by any process of this host (an xdist worker, say)
        with self._lock:
            children = list(self._children.values())
            self._children.clear()
            sources = [s for s in self._sources.values()
                       if s.owned and s.name not in self._kept_sources and s.name not in kept]
            self._sources.clear()
            self._closed = True
        for guest in children:
            try:
                guest.destroy()
            except GuestError as exc:
                errors.append(str(exc))
        for source in sources:
            try:
                self._delete_source(source)
            except GuestError as exc:
                errors.append(str(exc))
        if errors:
            raise GuestError("smol: teardown left machines behind: " + "; ".join(errors))

    # ---------------------------------------------------------------- sources

    def source_key(self, spec: VMSpec) -> str:
        """What makes two guests branchable from the same source; stable across processes."""
        identity = {"baseline": spec.baseline.digest, "kind": spec.baseline.kind, "cpus": self._cpus(spec),
                    "memory_mb": spec.memory_mb or self.default_memory_mb, "network": spec.network,
                    "allow_hosts": sorted(spec.allow_hosts), "env": sorted(spec.env.items()),
                    "target": self.target}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    def _cpus(self, spec: VMSpec) -> int:
        return max(1, math.ceil(spec.cpus or self.default_cpus))  # the engine takes whole vCPUs

    def source_guest(self, spec: VMSpec) -> SmolGuest:
        """The source for ``spec``, made if needed, as a guest to run baseline setup in.

        Its ``destroy()`` does nothing: sources die in :meth:`close`, after their children.
        Anything started in it must have finished before the first branch is taken.
        """
        source = self._source_for(spec)
        return SmolGuest(self._source_machine(source), name=source.name, target=self.target,
                         source=None, env=spec.env, owned=False)

    @classmethod
    def reap_unrecorded(cls) -> list[str]:
        """Machines labelled by us whose owner (pid, start time) is gone: children, then sources.

        Local machines always; cloud ones too when a cloud key is configured, but only those
        labelled by this host (a pid says nothing about another host's processes: TTL is
        what removes those).
        """
        from smol import SmolError

        removed: list[str] = []
        failed: list[str] = []
        kept = kept_machines()
        targets = ["local", "cloud"] if cloud_token_source() is not None else ["local"]
        here = host_identity()
        for target in targets:
            try:
                machines = list_owned({LABEL: "1"}, target=target)
            except SmolError as exc:
                failed.append(f"listing {target} machines: {_describe(exc)}")
                continue
            for machine in machines:
                if target == "cloud" and machine.labels.get("owner_host") != here:
                    continue
                if owner_alive(machine.labels) or machine.name in kept:
                    continue
                try:
                    destroy_recorded({"name": machine.name, "id": machine.name, "target": target})
                except GuestError as exc:
                    failed.append(str(exc))
                    continue
                removed.append(machine.name)
        if failed:
            raise GuestError(f"smol reap removed {len(removed)} machine(s) but: {'; '.join(failed)}")
        return removed

    def derive_baseline(self, baseline: Baseline, key: str, populate: Callable[[Guest], None],
                        scratch_guest: Callable[[Baseline], AbstractContextManager[Guest]]) -> Baseline:
        """The warm baseline of a microVM is its source machine: setup runs there, branches inherit it."""
        derived = dataclasses.replace(baseline, reference=f"{baseline.reference}{DERIVED}",
                                      digest=f"sha256:{key}")
        self._populate[derived.digest] = populate
        return derived

    def source_names(self) -> dict[str, str]:
        """key -> machine name (cloud: id) of every source this process owns, for xdist workers."""
        with self._lock:
            return {key: s.name for key, s in self._sources.items() if s.owned}

    def _key_lock(self, key: str) -> threading.RLock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.RLock())

    def _source_for(self, spec: VMSpec, *, populate: bool = True) -> _Source:
        key = self.source_key(spec)
        with self._key_lock(key):
            with self._lock:
                if self._closed:
                    raise ProvisionError("smol: the backend is closed")
                existing = self._sources.get(key)
            if existing is not None:
                return existing
            setup = self._populate.get(spec.baseline.digest) if populate else None
            if self._share_source is not None:
                # An xdist worker: the controller makes and owns the source, so it outlives us;
                # the first worker to need it warm runs the setup in it, once per host.
                source = _Source(key, self._share_source(spec), None, owned=False)
                if setup is not None:
                    self._warm_once(source, spec, setup)
            else:
                source = self._create_source(key, spec)
                if setup is not None:
                    try:
                        setup(self._source_guest_of(source, spec))
                    except BaseException:
                        with contextlib.suppress(GuestError):
                            self._delete_source(source)
                        raise
            with self._lock:
                self._sources[key] = source
            return source

    def _source_guest_of(self, source: _Source, spec: VMSpec) -> SmolGuest:
        return SmolGuest(self._source_machine(source), name=source.name, target=self.target,
                         source=None, env=spec.env, owned=False)

    def _warm_once(self, source: _Source, spec: VMSpec, setup: Callable[[SmolGuest], None]) -> None:
        """Run ``setup`` in a shared source unless another process already did (or failed to)."""
        from filelock import FileLock

        marks = state_dir() / "warm"
        marks.mkdir(parents=True, exist_ok=True)
        done, failed = marks / f"{source.name}.done", marks / f"{source.name}.failed"
        with FileLock(str(marks / f"{source.name}.lock")):
            if failed.exists():
                raise ProvisionError("smol: the baseline setup already failed in another worker: "
                                     + failed.read_text(errors="replace")[:2000])
            if done.exists():
                return
            try:
                setup(self._source_guest_of(source, spec))
            except BaseException as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}")
                raise
            done.write_text("ok")

    def _source_machine(self, source: _Source) -> Machine:
        if source.machine is not None:
            return source.machine
        from smol import Machine, SmolError

        with self._key_lock(source.key):
            if source.machine is None:
                try:
                    source.machine = Machine.connect(source.name, _connect(self.target))
                except SmolError as exc:
                    raise provision_error(f"smol: could not attach to source {source.name} "
                                          "made by another process", exc) from exc
            return source.machine

    def _image(self, baseline: Baseline) -> str | None:
        if baseline.kind == "bundled":
            if self.target == "cloud":
                raise UsageError("--smol-target=cloud needs --smol-baseline=<registry image>: "
                                 "the bundled Alpine rootfs exists only on this host")
            return None
        if baseline.kind == "registry":
            # A warm baseline is the same image plus setup run in its source; the name it is shown
            # by is not an image (and reaches another process only as the Baseline's fields).
            return baseline.reference.removesuffix(DERIVED)
        if self.target == "cloud":
            raise UsageError(f"--smol-baseline={baseline.reference}: smol cloud boots registry images only, "
                             f"not a local {baseline.kind}")
        assert baseline.path is not None
        if baseline.kind == "image-archive":
            self.check_baseline(baseline)
            return str(baseline.path)
        if baseline.kind == "rootfs-tar":
            from pytest_smolvm.baseline import unpack

            # smolmachines boots a rootfs directory but not a plain rootfs tarball.
            return str(unpack(baseline).path)
        return str(baseline.path)  # rootfs-dir or .smolmachine

    def machine_config(self, name: str, key: str, spec: VMSpec) -> MachineConfig:
        """The SDK config of the source for ``spec``: what ``Machine.create`` is given."""
        from smol import MachineConfig, ResourceSpec

        # allow_hosts turns networking on, scoped to the list (types.py:36-49): sending
        # network=False with it would ask for "off" and "these hosts" at once.
        resources = ResourceSpec(cpus=self._cpus(spec), memory_mb=spec.memory_mb or self.default_memory_mb,
                                 network=None if spec.allow_hosts else bool(spec.network),
                                 allow_hosts=list(spec.allow_hosts) or None)
        return MachineConfig(
            name=name, image=self._image(spec.baseline),
            labels={**spec.labels, **self.labels, SOURCE_LABEL: name, "key": key},
            resources=resources, env=dict(spec.env) or None, branchable=True,
            # persistent: another process (an xdist worker) can Machine.connect to it by name.
            persistent=True, ttl_seconds=self.ttl_seconds, ready_timeout_seconds=self.ready_timeout)

    def _create_source(self, key: str, spec: VMSpec) -> _Source:
        from smol import Machine, SmolError

        name = f"{SOURCE_PREFIX}{key[:10]}-{uuid.uuid4().hex[:8]}"
        config = self.machine_config(name, key, spec)
        try:
            machine = Machine.create(config, _connect(self.target))
        except SmolError as exc:
            # The SDK deletes a half-made machine itself; the name is unique so its lock file is ours.
            if self.target == "local":
                remove_fork_lock(name)
            raise provision_error(f"smol: could not boot source {name} from {spec.baseline.reference}",
                                  exc) from exc
        return _Source(key, machine.id if self.target == "cloud" else name, machine, owned=True)

    def _delete_source(self, source: _Source) -> None:
        """Delete a source, first deleting any children left (by a crashed worker, say)."""
        from smol import SmolError

        try:
            # Children carry their source's labels (the engine copies them on branch).
            for child in list_owned({SOURCE_LABEL: source.name}, target=self.target):
                if child.name != source.name and not child.is_source:
                    destroy_recorded({"name": child.name, "target": self.target})
        except (SmolError, GuestError):
            pass  # the delete below reports what matters
        if source.machine is not None:
            delete_machine(source.machine, source.name, self.target)
        else:
            destroy_recorded({"name": source.name, "target": self.target})
        for mark in (state_dir() / "warm").glob(f"{source.name}.*"):
            mark.unlink(missing_ok=True)


# --------------------------------------------------------------------------- reaping


def kept_machines() -> set[str]:
    """Machines kept with ``--smol-keep`` on this host, and the sources they need, as
    ``list_owned`` names them (cloud: ids). Labels cannot change after create, so the
    registry is where "kept" is written down."""
    from pytest_smolvm import registry

    kept: set[str] = set()
    for record in registry.records():
        if record.backend != SmolBackend.name or not record.kept:
            continue
        data = record.data
        kept.add(str(data.get("id") if data.get("target") == "cloud" else data.get("name")))
        if data.get("source"):
            kept.add(str(data["source"]))
    return kept


def owner_alive(labels: Mapping[str, str]) -> bool:
    """Whether the process that labelled a machine still runs (on this host, as far as we can tell).

    (pid, start time) identifies it; a machine labelled without a start time (a boot probe
    from an older version) gets the benefit of the doubt while its pid exists, so a live
    run's probe is never deleted under it.
    """
    try:
        owner = int(labels.get("owner_pid") or 0)
    except ValueError:
        return False
    if owner <= 0:
        return False
    start = labels.get("owner_start") or ""
    if start.isdigit():
        return is_alive(owner, int(start))
    return process_start_time(owner) is not None


def list_owned(labels: Mapping[str, str], target: str = "local") -> list[OwnedMachine]:
    """Machines whose labels include ``labels``, children before sources (the delete order)."""
    from smol import Machine

    summaries = Machine.list(_connect(target), labels=dict(labels))
    owned = [OwnedMachine(s.id if target == "cloud" else s.name, s.state, dict(s.labels),
                          bool(s.branchable) or s.name.startswith(SOURCE_PREFIX)) for s in summaries]
    return sorted(owned, key=lambda m: (m.is_source, m.name))


def destroy_recorded(data: Mapping[str, Any]) -> None:
    """Delete a machine known only by its record; an already-gone machine is not an error."""
    from smol import Machine, SmolError

    target = str(data.get("target") or "local")
    name = str(data.get("id") if target == "cloud" and data.get("id") else data.get("name") or "")
    if not name:
        return
    try:
        Machine.delete_by_name(name, _connect(target))
    except SmolError as exc:
        if not _is_gone(exc):
            raise GuestError(f"could not delete smol machine {name}: {_describe(exc)}") from exc
    if target == "local":
        remove_fork_lock(name)


__all__ = ["OwnedMachine", "SmolBackend", "SmolGuest", "cloud_token_source", "destroy_recorded",
           "list_owned", "read_local_logs"]
