"""Running a command in a smol machine: exit status, bounded output, timeouts and cancellation.

On the cloud one SDK call carries the output byte-exact: a resumable exec's output comes as
base64 pieces (1.37.3, transport.py:2321-2346; bounded by ``sdk.exec_bounded``), and on a control
plane without them ``ExecOptions(output="b64")`` asks for it (the ``?output=b64`` query;
transport.py:1297-1331). The local SDK hands output back already decoded
as lossy UTF-8 text (transport.py:787-793) and has no byte-exact form, so there each command's
stdout/stderr go to files in the guest, trimmed there and read back by :mod:`.streamed_read`.
That also means a background process that keeps the command's stdout open can never hold a local exec
open. A call with a user, live output or a cancel goes through ``handle.stream_exec`` on both
targets.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_smolvm import limits
from pytest_smolvm.backends.base import Cancel, GuestExecResult, OutputCallback
from pytest_smolvm.backends.output import bounded
from pytest_smolvm.backends.smol import handle as smol_handle
from pytest_smolvm.backends.smol.common import KILLED_EXITS, TIMEOUT_CODES, TIMEOUT_EXIT, _describe, _is_gone
from pytest_smolvm.backends.smol.sdk import exec_bounded, exec_cancellable
from pytest_smolvm.backends.smol.streamed_read import read_capped
from pytest_smolvm.errors import GuestError

if TYPE_CHECKING:
    from smol import Machine

# The agent kills a timed-out command itself; this host-side backstop only fires if it does not.
# mkdir/tar/rm for file transfers: generous for big trees, but a wedged guest must not hang a test.
SCRATCH = "/tmp/.pytest-smolvm"  # per-guest exec plumbing files (one exec at a time per guest)
PLUMBING_OUTPUT_LIMIT = 1 << 20  # bytes of each stream kept of the plugin's own commands (read for errors)
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


class ExecPlumbing:
    """The exec half of :class:`~pytest_smolvm.backends.smol.guest.SmolGuest`."""

    name: str
    _machine: Machine
    _target: str
    _env: dict[str, str]
    _lock: threading.Lock
    _free_scratch: list[str]

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
            with exec_bounded(timeout, output_limit) as bound:
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
        out, err = result.stdout_bytes, result.stderr_bytes
        truncated = tuple(name for name, data in (("stdout", out), ("stderr", err)) if len(data) > limit or bound.cut)
        return GuestExecResult(TIMEOUT_EXIT if timed_out else result.exit_code, bounded(out, limit),
                               bounded(err, limit), timed_out, truncated)

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
        stdout, cut_out = self._read_output(f"{scratch}.out", limit, dropped[0], required=not timed_out)
        stderr, cut_err = self._read_output(f"{scratch}.err", limit, dropped[1], required=False)
        truncated = tuple(stream for stream, cut in (("stdout", cut_out), ("stderr", cut_err)) if cut)
        return GuestExecResult(exit_code, stdout, stderr, timed_out, truncated)

    def _raw_exec(self, command: list[str], *, env: Mapping[str, str], workdir: str | None,
                  timeout: float | None, user: str | None = None, stdin: str | None = None) -> Any:
        """One SDK exec, with a host-side cancel in case the guest agent never enforces the timeout."""
        from smol import ExecOptions

        opts = ExecOptions(env=dict(env) or None, workdir=workdir, timeout=timeout, user=user, stdin=stdin)
        canceller, run = exec_cancellable(self._machine, command, opts) if timeout is not None else (None, None)
        if timeout is None or canceller is None or run is None:  # the cloud: bounded in the SDK's exec
            with exec_bounded(timeout, PLUMBING_OUTPUT_LIMIT):
                return self._machine.exec(command, opts)
        timer = threading.Timer(timeout + limits.LIMITS.smol_exec_cancel_grace, canceller.cancel)
        timer.daemon = True
        timer.start()
        try:
            return run()
        finally:
            timer.cancel()

    def _read_output(self, path: str, limit: int, dropped: int, *, required: bool) -> tuple[bytes, bool]:
        """The output file, at most ``limit`` bytes, and whether it was cut.

        Read as a stream and stopped at the cap, whatever the in-guest trim reported: a process
        the command left behind may have grown the file after it."""
        from smol import SmolError

        try:
            data, longer = read_capped(self._machine, path, limit, name=self.name, what="exec output",
                                       timeout=limits.LIMITS.smol_plumbing)
        except GuestError as exc:
            cause = exc.__cause__
            if required and not (isinstance(cause, SmolError) and _is_gone(cause)):
                raise GuestError(f"exec in {self.name}: could not read its output: {exc}") from exc
            return b"", False
        return data, bool(dropped) or longer

    def _sdk_write(self, path: str, data: bytes, mode: int | None) -> None:
        from smol import SmolError

        try:
            self._machine.write_file(path, data, mode)
        except SmolError as exc:
            raise GuestError(f"write_file {path} in {self.name}: {_describe(exc)}") from exc
