"""The smol backend's half of the agent-facing handle: streamed exec, guest users, typed file errors.

Kept apart from ``smol.py`` (machines, sources, lifetime) so that each stays one thing. What the
SDK offers decides the shape (read in ``smol/transport.py`` and ``smol/types.py``):

- ``Machine.exec_stream`` yields output as it arrives, but as text: non-UTF-8 bytes are
  replaced. A streamed exec (``on_output``, ``cancel`` or ``user`` given) is therefore not
  byte-exact; the plain exec, through files, stays byte-exact. ``stream.kill()`` is thread-safe
  and kills the command's process tree.
- ``ExecOptions.user`` runs a command as an image's user; a bare VM (no image) refuses it.
- ``read_file``/``write_file`` have no user and no errno: a failure is classified by a small
  shell check in the guest (run only after a failure), and a user's write runs as a command of
  that user, its bytes carried as base64 on stdin (which is text). Reads go through
  :mod:`.streamed_read`, for every user.
"""

from __future__ import annotations

import base64
import errno
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_smolvm.backends.argv import MAX_ARG_STRLEN, argv_size, too_big
from pytest_smolvm.backends.base import Cancel, GuestExecResult, OutputCallback
from pytest_smolvm.backends.output import BoundedBuffer
from pytest_smolvm.backends.smol.common import exec_error
from pytest_smolvm.backends.smol.sdk import exec_bounded
from pytest_smolvm.backends.smol.streamed_read import read_capped
from pytest_smolvm.errors import GuestError, GuestUserError

if TYPE_CHECKING:
    from smol import Machine

TIMEOUT_EXIT = 124
KILLED_EXITS = frozenset({TIMEOUT_EXIT, 128 + 9, 128 + 15, -9, -15})

# Exit status = the errno of what is wrong with path $1 for operation $2 (read, write, tree:
# archive it, dir: enter it), 0 if nothing is. Runs as the operation's user, so -r/-w/-x
# answer for that user.
CLASSIFY_SCRIPT = r"""
p=$1 op=$2 d=$(dirname -- "$1")
while [ "$d" != / ] && [ ! -e "$d" ]; do d=$(dirname -- "$d"); done
case "$p" in */) p=${p%/};; esac
q=$(dirname -- "$p")
[ -e "$q" ] && [ ! -d "$q" ] && exit 20
[ -d "$d" ] || exit 20
if [ "$op" = dir ]; then
  [ -e "$p" ] || exit 2; [ -d "$p" ] || exit 20; [ -x "$p" ] || exit 13; exit 0
fi
if [ "$op" = into ] && [ -e "$p" ]; then  # copy_in's destination: a directory to fill, its mode set
  [ -d "$p" ] || exit 20; [ -w "$p" ] && [ -x "$p" ] || exit 13
  u=$(id -u); [ "$u" = 0 ] || [ "$(stat -c %u -- "$p")" = "$u" ] || exit 1; exit 0
fi
[ "$op" = into ] && op=write
if [ ! -e "$p" ]; then
  [ "$op" = write ] || exit 2
  [ -w "$d" ] || exit 13
  exit 0
fi
if [ "$op" = tree ]; then
  [ -r "$p" ] || exit 13; [ -d "$p" ] && { [ -x "$p" ] || exit 13; }; exit 0
fi
[ -d "$p" ] && exit 21
[ "$op" = read ] && { [ -r "$p" ] || exit 13; }
[ "$op" = write ] && { [ -w "$p" ] || exit 13; }
exit 0
"""
# Write stdin's base64 to $1 (parents made, mode $2 if given).
WRITE_SCRIPT = r"""
mkdir -p -- "$(dirname -- "$1")" && base64 -d >"$1" && { [ -z "$2" ] || chmod "$2" "$1"; }
"""

PASSWD_LIMIT = 4 << 20  # bytes of the guest's /etc/passwd parsed at most

Runner = Callable[..., Any]  # SmolGuest._raw_exec: (command, *, env, workdir, timeout, user=None) -> ExecResult


def resolve_user(machine: Machine, user: str, name: str) -> tuple[str, str]:
    """(name, home) of guest user ``user`` (a name or uid), from the guest's /etc/passwd.

    Looked up here rather than left to the engine, whose answer to an unknown user differs
    by target (an error, or a failed command): the guest's file, parsed with a byte cap.
    """
    try:
        data, _longer = read_capped(machine, "/etc/passwd", PASSWD_LIMIT, name=name, what="reading /etc/passwd",
                                    timeout=60)
    except GuestError as exc:
        raise GuestUserError(f"user {user!r} in {name}: cannot read the guest's /etc/passwd: {exc}") from exc
    entries = [line.split(":") for line in data.decode("utf-8", "replace").splitlines()]
    entries = [e for e in entries if len(e) >= 6 and e[0] and not e[0].startswith("#")]
    entry = next((e for e in entries if e[0] == user), None)
    if entry is None and user.isdigit():
        entry = next((e for e in entries if e[2] == user), None)
    if entry is None:
        raise GuestUserError(f"user {user!r} is not in the guest's /etc/passwd ({name})")
    return entry[0], entry[5] or "/"


def user_env(env: Mapping[str, str], explicit: set[str], user: str, home: str) -> dict[str, str]:
    """``env`` with the user's HOME, USER and LOGNAME, unless the test set them itself."""
    merged = dict(env)
    for key, value in (("HOME", home), ("USER", user), ("LOGNAME", user)):
        if key not in explicit:
            merged[key] = value
    return merged


# Runs argv with its shell's pid in file $0, so that a cancel can kill it even where closing
# the stream does not (on the cloud that is up to the control plane).
PIDFILE_WRAPPER = 'echo $$ >"$0"; "$@"; rc=$?; rm -f -- "$0"; exit $rc'
KILL_SCRIPT = r"""
p=$(cat -- "$1" 2>/dev/null) || exit 0
kill -9 -- "-$p" 2>/dev/null
for c in $(pgrep -P "$p"); do pkill -9 -P "$c"; kill -9 "$c"; done 2>/dev/null
kill -9 "$p" 2>/dev/null; rm -f -- "$1"; exit 0
"""


def stream_exec(machine: Machine, run: Runner, argv: Sequence[str], *, name: str, env: Mapping[str, str],
                workdir: str | None, stdin: bytes | None, timeout: float | None, output_limit: int,
                user: str | None, on_output: OutputCallback | None, cancel: Cancel | None) -> GuestExecResult:
    """One exec through ``exec_stream``: output as it arrives, killable from another thread."""
    from smol import ExecOptions, SmolError

    pidfile = f"/tmp/.pytest-smolvm-{uuid.uuid4().hex[:12]}.pid"
    argv = ["/bin/sh", "-c", PIDFILE_WRAPPER, pidfile, *argv]

    text_stdin = None
    if stdin:
        try:
            text_stdin = stdin.decode("utf-8")  # the SDK carries stdin as text only
        except UnicodeDecodeError:
            raise GuestError(f"exec in {name}: the smol backend streams only UTF-8 stdin; pass "
                             "binary input in a file (write_file) instead") from None
    opts = ExecOptions(env=dict(env) or None, workdir=workdir, timeout=timeout, user=user, stdin=text_stdin)
    out, err = BoundedBuffer(output_limit), BoundedBuffer(output_limit)
    streams: list[Any] = []  # the stream, once the SDK has handed it over

    def kill() -> None:
        # Closing the stream kills the command locally; on the cloud that is up to the control
        # plane, and a blocked read may not even notice. So the command is killed by its pid
        # too. In a thread of its own: the cancelling thread may be an event loop.
        if streams:
            streams[0].kill()
        try:
            run(["/bin/sh", "-c", KILL_SCRIPT, "pytest-smolvm", pidfile], env={}, workdir=None, timeout=60)
        except Exception:  # the guest is gone: nothing is left to kill
            pass

    def kill_soon() -> None:
        threading.Thread(target=kill, name="smol-exec-cancel", daemon=True).start()

    # Before the stream exists: a resumable exec's start asks the node to wait up to 20 s for
    # the command's first output (waitSeconds, transport.py:2225, 2264), and a cancel meanwhile
    # must reach the command.
    if cancel is not None:
        cancel.add(kill_soon)
    started = time.monotonic()
    try:
        with exec_bounded(timeout, None) as bound:  # its output is bounded here, as it arrives
            stream = machine.exec_stream(list(argv), opts)
    except SmolError as exc:
        if cancel is not None:
            cancel.remove(kill_soon)
        raise exec_error(exc, name, user) from exc
    streams.append(stream)
    if cancel is not None and cancel.cancelled:
        kill_soon()  # the kill may have come before the command wrote its pid, or had no stream
    exit_code: int | None = None
    try:
        for event in stream:
            kind = event.get("kind")
            if kind in ("stdout", "stderr"):
                data = str(event.get("data", "")).encode("utf-8", "surrogateescape")
                if on_output is not None:
                    on_output(kind, data)
                (out if kind == "stdout" else err).add(data)
            elif kind == "exit":
                exit_code = int(event.get("exit_code", -1))
            elif kind == "error" and not (cancel is not None and cancel.cancelled):
                raise exec_error(SmolError("EXEC_FAILED", str(event.get("message", ""))), name, user)
    except SmolError as exc:
        if timeout is None or exc.code not in ("TIMEOUT", "CANCELLED", "INTERRUPTED"):
            raise exec_error(exc, name, user) from exc
        exit_code = TIMEOUT_EXIT
    finally:
        if cancel is not None:
            cancel.remove(kill_soon)
        stream.close()
    cancelled = cancel is not None and cancel.cancelled
    if exit_code is None:
        if not cancelled:
            raise GuestError(f"exec in {name}: the stream ended without an exit status")
        exit_code = 128 + 9
    elapsed = time.monotonic() - started
    timed_out = timeout is not None and exit_code in KILLED_EXITS and elapsed >= timeout and not cancelled
    truncated = tuple(s for s, b in (("stdout", out), ("stderr", err)) if b.dropped or bound.cut)
    return GuestExecResult(TIMEOUT_EXIT if timed_out else exit_code, out.value(), err.value(), timed_out,
                           truncated, cancelled)


# Exit status = the errno execve would give for program $1 (PATH search as execvp), 0 if it runs.
PROGRAM_SCRIPT = r"""
case "$1" in
  */*) [ -e "$1" ] || exit 2; [ -d "$1" ] && exit 13; [ -x "$1" ] || exit 13; exit 0;;
esac
command -v -- "$1" >/dev/null 2>&1 || exit 2
exit 0
"""


GUEST_ARG_MAX = 2 << 20  # a Linux guest's ARG_MAX under the default 8 MiB stack


def check_arg_size(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Refuse, as execve would with E2BIG, what no Linux guest with a default stack accepts.

    Checked here because the engine reports a failed execve as a generic error, if at all.
    """
    size = argv_size(argv, dict(env))
    longest = max((len(a.encode()) + 1 for a in [*argv, *(f"{k}={v}" for k, v in env.items())]), default=0)
    if size > GUEST_ARG_MAX or longest > MAX_ARG_STRLEN:
        raise too_big(size, GUEST_ARG_MAX, argv[0])


def program_error(run: Runner, program: str, *, env: Mapping[str, str], workdir: str | None,
                  user: str | None) -> OSError | None:
    """After an exit of 126/127: the OSError subprocess would raise for ``program``, if any.

    Asked of the guest only then, so the common call pays nothing; a program that exists and
    exits 127 by itself is left alone.
    """
    try:
        result = run(["/bin/sh", "-c", PROGRAM_SCRIPT, "pytest-smolvm", program], env=dict(env),
                     workdir=workdir, timeout=60, user=user)
    except Exception:  # the guest is gone or broken: the result already says what happened
        return None
    code = int(result.exit_code)
    if code in (errno.ENOENT, errno.EACCES):
        return OSError(code, os.strerror(code), program)
    return None


def classify(run: Runner, path: str, op: str, user: str | None) -> OSError | None:
    """The OSError the failed ``op`` of ``path`` stands for, or None if no check finds one."""
    try:
        result = run(["/bin/sh", "-c", CLASSIFY_SCRIPT, "pytest-smolvm", path, op], env={}, workdir=None,
                     timeout=60, user=user)
    except Exception:  # the guest is gone or broken: the caller's GuestError says so
        return None
    code = int(result.exit_code)
    if code in (errno.EPERM, errno.ENOENT, errno.EACCES, errno.ENOTDIR, errno.EISDIR):
        return OSError(code, os.strerror(code), path)
    return None


def _run_as(run: Runner, command: list[str], *, user: str, name: str, stdin: str | None = None) -> Any:
    from smol import SmolError

    try:
        return run(command, env={}, workdir=None, timeout=600, user=user, stdin=stdin)
    except SmolError as exc:
        raise exec_error(exc, name, user) from exc


def write_as(run: Runner, path: str, data: bytes, mode: int | None, *, user: str, name: str) -> None:
    encoded = base64.b64encode(data).decode("ascii")
    result = _run_as(run, ["/bin/sh", "-c", WRITE_SCRIPT, "pytest-smolvm", path, "" if mode is None else f"{mode:o}"],
                     user=user, name=name, stdin=encoded)
    if result.exit_code != 0:
        raise classify(run, path, "write", user) or GuestError(
            f"write_file {path} in {name} as {user}: {result.stderr.strip() or f'exit {result.exit_code}'}")
