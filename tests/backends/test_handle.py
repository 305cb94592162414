"""The handle agent frameworks drive (issue 12), held to one contract on every backend.

Big argv, guest users, typed errors, caps, live output, concurrent calls from threads and
from event loops, cancellation. Part of the conformance suite: ``backend`` is parametrized
in ``conftest.py``, so each test runs against a real guest of every backend that runs here.
"""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm.errors import GuestUserError
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.limits import LIMITS
from tests.backends.conftest import MakeGuest

AGENT_UID = 1234
ADD_AGENT = (f"echo 'agent:x:{AGENT_UID}:{AGENT_UID}:Agent:/home/agent:/bin/sh' >> /etc/passwd && "
             f"echo 'agent:x:{AGENT_UID}:' >> /etc/group && echo 'team:x:2000:someone,agent' >> /etc/group && "
             f"mkdir -p /home/agent && chown {AGENT_UID}:{AGENT_UID} /home/agent && "
             "echo secret > /root/secret && chmod 600 /root/secret")


def _with_agent(make_guest: MakeGuest, **vm_settings: Any) -> VM:
    vm, guest = make_guest()
    vm.exec(ADD_AGENT, check=True)
    if not vm_settings:
        return vm
    return VM(guest, backend=vm.backend, isolation=vm.isolation, **vm_settings)


def _elapsed(fn: Callable[[], object]) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def _best_of_two(fn: Callable[[], object]) -> float:
    """Wall time of ``fn``, the better of two runs: a loaded 2-core CI host can stall one."""
    first = _elapsed(fn)
    return first if first < 1.5 else min(first, _elapsed(fn))


# --------------------------------------------------------------------------- big requests


def test_a_megabyte_of_arguments_and_a_big_env(vm: VM) -> None:
    args = [f"{i:02d}" + "a" * (64 * 1024 - 2) for i in range(16)]  # 1 MiB of argv
    env = {"BIG": "e" * 100_000}
    r = vm.exec(["/bin/sh", "-c", 'echo $#; printf %s "$@" | wc -c; echo ${#BIG}; echo "${16%%a*}"', "sh", *args],
                env=env, check=True)
    assert r.stdout.split() == ["16", str(16 * 64 * 1024), "100000", "15"]
    assert vm.exec(["cat"], stdin=b"s" * (4 << 20)).stdout_bytes == b"s" * (4 << 20)


@pytest.mark.parametrize("argv", [
    ["true", "x" * 200_000],  # one argument over the kernel's per-string limit
    ["true", *(["y" * 100_000] * 40)],  # 4 MB in all: over this host's ARG_MAX
    ["true", "z" * (64 << 20)],  # far over any ARG_MAX: refused before it is sent
], ids=["one-huge-arg", "over-arg-max", "64-MiB"])
def test_beyond_arg_max_is_a_clear_error_and_the_guest_lives_on(vm: VM, argv: list[str]) -> None:
    with pytest.raises(OSError) as info:
        vm.exec(argv)
    assert info.value.errno == errno.E2BIG
    assert "ARG_MAX" in str(info.value)
    assert vm.exec("echo alive").stdout == "alive\n"
    with pytest.raises(OSError) as shell:  # a shell string is argv too: same limit, same error
        vm.exec("true " + " ".join(argv[1:]))
    assert shell.value.errno == errno.E2BIG
    assert vm.exec("echo still alive").stdout == "still alive\n"


# --------------------------------------------------------------------------- users


def test_exec_as_a_user_by_name_and_by_uid(make_guest: MakeGuest) -> None:
    vm = _with_agent(make_guest)
    script = 'id -u; id -g; id -G; echo "$HOME $USER"; pwd'
    by_name = vm.exec(script, user="agent", workdir="/home/agent", check=True)
    assert by_name.stdout.splitlines() == [str(AGENT_UID), str(AGENT_UID), f"{AGENT_UID} 2000",
                                           "/home/agent agent", "/home/agent"]
    assert vm.exec(script, user=AGENT_UID, workdir="/home/agent", check=True).stdout == by_name.stdout
    assert vm.exec(script, user=str(AGENT_UID), workdir="/home/agent", check=True).stdout == by_name.stdout
    assert vm.exec("echo $HOME", user="agent", env={"HOME": "/custom"}).stdout == "/custom\n"
    assert vm.exec("id -u").stdout == "0\n"  # root stays the default
    vm.exec("mkdir -p /tmp/agent-scratch && echo x > /tmp/agent-scratch/f", user="agent", check=True)  # 1777 /tmp
    denied = vm.exec("cat /root/secret", user="agent")
    assert denied.exit_code != 0 and "ermission denied" in denied.stderr
    with pytest.raises(GuestUserError, match="nosuchuser"):
        vm.exec("true", user="nosuchuser")
    with pytest.raises(GuestUserError, match="4242"):
        vm.exec("true", user=4242)


def test_default_user_applies_to_exec_and_every_file_operation(make_guest: MakeGuest, tmp_path: Path) -> None:
    vm = _with_agent(make_guest, user="agent")
    assert vm.exec("id -u").stdout == f"{AGENT_UID}\n"
    assert vm.exec("id -u", user="root").stdout == "0\n"
    vm.write_file("/home/agent/mine.txt", "mine\n")
    assert vm.exec("stat -c %u /home/agent/mine.txt").stdout == f"{AGENT_UID}\n"
    assert vm.read_file("/home/agent/mine.txt") == b"mine\n"
    with pytest.raises(PermissionError) as write_denied:
        vm.write_file("/etc/not-yours", "x")
    assert write_denied.value.errno == errno.EACCES and write_denied.value.filename == "/etc/not-yours"
    with pytest.raises(PermissionError) as read_denied:
        vm.read_file("/root/secret")
    assert read_denied.value.filename == "/root/secret"
    vm.exec("chmod 444 /home/agent/mine.txt", check=True)
    with pytest.raises(PermissionError):
        vm.write_file("/home/agent/mine.txt", "overwrite")  # a read-only file stays read-only
    with pytest.raises(PermissionError):
        vm.copy_out("/root", tmp_path / "root-tree")
    vm.exec("mkdir /srv/t && echo s > /srv/t/secret && chmod 600 /srv/t/secret", user="root", check=True)
    with pytest.raises(PermissionError):
        vm.copy_out("/srv/t", tmp_path / "half-readable")  # the guest's tar is refused the file
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("f\n")
    vm.copy_in(src, "/home/agent/tree")
    assert vm.exec("stat -c %u /home/agent/tree/f").stdout == f"{AGENT_UID}\n"
    assert vm.exec("ls -A /tmp | grep -F .tar || true", user="root").stdout == ""  # no staged archive left, as any user
    with pytest.raises(PermissionError):
        vm.copy_in(src, "/etc/tree")
    # Into a directory that is there, writable, but not the user's: a tree carries its own mode
    # onto its destination (tar -p), which only the directory's owner may set.
    with pytest.raises(PermissionError) as not_owner:
        vm.copy_in(src, "/tmp")
    assert not_owner.value.filename == "/tmp"
    assert vm.exec("stat -c %a /tmp").stdout == "1777\n"


def test_unknown_default_user_is_a_clear_error(make_guest: MakeGuest) -> None:
    _vm, guest = make_guest()
    vm = VM(guest, user="ghost")
    with pytest.raises(GuestUserError, match="ghost"):
        vm.exec("true")
    with pytest.raises(GuestUserError, match="ghost"):
        vm.read_file("/etc/hostname")


def test_guest_user_ids_out_of_the_kernels_range_are_a_clear_error(make_guest: MakeGuest) -> None:
    """The guest writes its own /etc/passwd and /etc/group: an id past 2**32 made the request's
    setuid (or setgroups) raise OverflowError, reported as the command's own failure (exit 1)."""
    vm, _guest = make_guest()
    vm.exec("echo 'big:x:99999999999:0::/:/bin/sh' >> /etc/passwd; "
            "echo 'four:x:4294967295:0::/:/bin/sh' >> /etc/passwd; "
            "echo 'huge:x:99999999999:root' >> /etc/group", check=True)
    for user in ("big", "four"):
        with pytest.raises(GuestUserError, match=f"{user}.*malformed"):
            vm.exec("true", user=user)
    # a group line out of range names no group: root's own commands are not broken by it
    assert vm.exec("id -u", user="root", check=True).stdout == "0\n"


# --------------------------------------------------------------------------- typed errors


def test_file_errors_are_oserror_subclasses_naming_the_guest_path(vm: VM) -> None:
    cases: list[tuple[Callable[[], object], type[OSError], int, str]] = [
        (lambda: vm.read_file("/no/such/file"), FileNotFoundError, errno.ENOENT, "/no/such/file"),
        (lambda: vm.read_file("/etc"), IsADirectoryError, errno.EISDIR, "/etc"),
        (lambda: vm.read_file("/etc/hostname/x"), NotADirectoryError, errno.ENOTDIR, "/etc/hostname/x"),
        (lambda: vm.write_file("/etc", "x"), IsADirectoryError, errno.EISDIR, "/etc"),
    ]
    for call, kind, number, path in cases:
        with pytest.raises(kind) as info:
            call()
        assert info.value.errno == number and info.value.filename == path, info.value


def test_argv_exec_of_a_missing_or_unrunnable_program_raises_like_subprocess(vm: VM) -> None:
    with pytest.raises(FileNotFoundError) as missing:
        vm.exec(["no-such-program-xyz", "arg"])
    assert missing.value.errno == errno.ENOENT and "no-such-program-xyz" in str(missing.value)
    with pytest.raises(PermissionError):
        vm.exec(["/etc/hostname"])
    with pytest.raises(FileNotFoundError):
        vm.exec(["/bin/true"], workdir="/no/such/dir")
    with pytest.raises(FileNotFoundError):
        vm.exec(["no-such-program-xyz"], user="nobody")  # the same through a user switch
    # A shell string keeps shell semantics.
    assert vm.exec("no-such-program-xyz").exit_code == 127
    assert vm.exec("/etc/hostname").exit_code == 126


def test_bad_exec_arguments_are_one_line_errors_before_the_guest_is_asked(vm: VM) -> None:
    # Each used to reach the guest: a TypeError from iterating None, a GuestError "bad request"
    # for a non-string value, and a name with "=" quietly set another variable.
    for cmd in (None, 42, [1, 2], b"true"):
        with pytest.raises(TypeError, match=r"^exec: cmd must be a string .* or a list of strings"):
            vm.exec(cmd)  # type: ignore[arg-type]
    for env in ({"A": 1}, {1: "a"}, {"A=B": "x"}, {"": "x"}, {"A": "x\0y"}, ["A=1"]):
        with pytest.raises(ValueError, match=r"^exec: env"):
            vm.exec("true", env=env)  # type: ignore[arg-type]
    # stdin=5 was an AttributeError from deep in the backend; write_file(path, 5) wrote five NUL
    # bytes (bytes(5)); mode="644" came back as the guest's TypeError, and mode=0o17777 was taken.
    for stdin in (5, ["x"]):
        with pytest.raises(TypeError, match=r"^exec: stdin must be str or bytes, got "):
            vm.exec("cat", stdin=stdin)  # type: ignore[arg-type]
    for mode in ("644", 0o17777, -1, True):
        with pytest.raises(ValueError, match=r"^write_file: mode must be an int from 0 to 0o7777"):
            vm.write_file("/tmp/m", "x", mode=mode)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^write_file: data must be str or bytes, got int"):
        vm.write_file("/tmp/m", 5)  # type: ignore[arg-type]
    # and a NUL in an argv was the guest's "bad request" GuestError, user=["root"] a user not in
    # /etc/passwd, on_output=5 a TypeError from the output pump, copy_in(5, ...) Path's TypeError
    for nul_cmd in (["echo", "a\0b"], "echo a\0b"):
        with pytest.raises(ValueError, match=r"^exec: cmd holds a NUL byte"):
            vm.exec(nul_cmd)
    for user in (["root"], "root:root", -1, ""):
        with pytest.raises(ValueError, match=r"^exec: user=.*: expected a user name or uid"):
            vm.exec("true", user=user)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^exec: on_output must be a callable"):
        vm.exec("echo hi", on_output=5)  # type: ignore[arg-type]
    for check in ("no", None, 1):  # "no" is truthy: the failure the caller meant to read would raise
        with pytest.raises(TypeError, match=r"^exec: check must be True or False, got"):
            vm.exec("false", check=check)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^copy_in: src must be a host path"):
        vm.copy_in(5, "/tmp/m")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^copy_out: dest must be a host path"):
        vm.copy_out("/etc/hostname", 5)  # type: ignore[arg-type]
    asked = len(vm.transcript)
    assert vm.exec("echo $A", env={"A": "1"}).stdout == "1\n" and len(vm.transcript) == asked + 1
    assert vm.exec("test -e /tmp/m").exit_code == 1  # none of the refused calls reached the guest
    vm.write_file("/tmp/m", bytearray(b"ok"), mode=0o600)  # type: ignore[arg-type]  # bytes-like data still goes
    assert vm.exec("stat -c %a /tmp/m && cat /tmp/m").stdout == "600\nok"


def test_a_guest_path_with_a_nul_byte_is_a_one_line_error_before_the_guest_is_asked(vm: VM, tmp_path: Path) -> None:
    # It was the guest's own "embedded null byte", raised as a GuestError: the guest's fault.
    for call, what in ((lambda: vm.read_file("/etc\0x"), "read_file"),
                       (lambda: vm.write_file("/tmp/a\0b", "x"), "write_file"),
                       (lambda: vm.copy_in(tmp_path, "/tmp/a\0b"), "copy_in"),
                       (lambda: vm.copy_out("/etc\0x", tmp_path / "out"), "copy_out"),
                       (lambda: vm.exec("true", workdir="/tmp\0x"), "exec")):
        with pytest.raises(ValueError, match=rf"^{what}: guest path must be a non-empty string without a NUL byte"):
            call()
    assert vm.transcript == [] and vm.exec("ls /tmp").stdout == ""  # none of them reached the guest


# --------------------------------------------------------------------------- caps and paths


def test_read_file_cap(vm: VM) -> None:
    vm.exec("head -c 100000 /dev/zero > /tmp/big", check=True)
    assert len(vm.read_file("/tmp/big", max_bytes=100_000)) == 100_000
    with pytest.raises(OSError) as info:
        vm.read_file("/tmp/big", max_bytes=99_999)
    assert info.value.errno == errno.EFBIG and "max_bytes=99999" in str(info.value)
    vm.exec(f"head -c {LIMITS.read_bytes + 1} /dev/zero > /tmp/huge", check=True)
    with pytest.raises(OSError) as default_cap:
        vm.read_file("/tmp/huge")
    assert default_cap.value.errno == errno.EFBIG
    vm.exec("rm /tmp/huge", check=True)
    with pytest.raises(ValueError, match="max_bytes"):
        vm.read_file("/tmp/big", max_bytes=0)


def test_output_limit_and_truncated(make_guest: MakeGuest) -> None:
    _vm, guest = make_guest()
    vm = VM(guest, output_limit=1000)
    out = vm.exec("head -c 5000 /dev/zero | tr '\\0' o; echo fine >&2")
    assert out.truncated == ("stdout",) and out.stderr == "fine\n" and len(out.stdout_bytes) < 1100
    err = vm.exec("head -c 5000 /dev/zero | tr '\\0' e >&2")
    assert err.truncated == ("stderr",)
    both = vm.exec("head -c 5000 /dev/zero; head -c 5000 /dev/zero >&2")
    assert both.truncated == ("stdout", "stderr")
    assert vm.exec("echo small").truncated == ()


def test_relative_guest_paths_resolve_against_workdir(vm: VM, tmp_path: Path) -> None:
    assert vm.workdir.startswith("/")
    base = vm.workdir.rstrip("/")
    vm.exec("mkdir -p rel-dir", workdir=vm.workdir, check=True)
    vm.write_file("rel-dir/f.txt", "relative\n")
    assert vm.read_file(f"{base}/rel-dir/f.txt") == b"relative\n"
    assert vm.read_file("rel-dir/f.txt") == b"relative\n"
    assert vm.exec("pwd", workdir="rel-dir").stdout == f"{base}/rel-dir\n"
    assert vm.copy_out("rel-dir", tmp_path / "out").joinpath("f.txt").read_text() == "relative\n"


# --------------------------------------------------------------------------- timeouts


def test_timeout_omitted_is_the_default_and_none_is_no_limit(make_guest: MakeGuest) -> None:
    _vm, guest = make_guest()
    vm = VM(guest, default_timeout=1)
    assert vm.exec("sleep 30").timed_out
    unlimited = vm.exec("sleep 2; echo done", timeout=None)
    assert not unlimited.timed_out and unlimited.stdout == "done\n"
    assert vm.exec("sleep 30", timeout=0.5).timed_out


# --------------------------------------------------------------------------- live output


def test_on_output_streams_chunks_as_they_arrive(vm: VM) -> None:
    started = time.monotonic()
    seen: list[tuple[str, bytes, float]] = []
    r = vm.exec("echo first; sleep 1.5; echo second >&2; echo third",
                on_output=lambda stream, data: seen.append((stream, data, time.monotonic() - started)))
    assert r.exit_code == 0
    assert seen[0][:2] == ("stdout", b"first\n")
    assert seen[0][2] < 1.2, f"the first chunk came only after {seen[0][2]:.2f}s"
    assert b"".join(d for s, d, _ in seen if s == "stdout") == r.stdout_bytes == b"first\nthird\n"
    assert b"".join(d for s, d, _ in seen if s == "stderr") == r.stderr_bytes == b"second\n"


# --------------------------------------------------------------------------- concurrency


def test_concurrent_calls_from_threads_run_at_once(vm: VM) -> None:
    vm.exec("true")
    elapsed = _best_of_two(lambda: _in_threads([lambda: vm.exec("sleep 1", check=True)] * 3))
    assert elapsed < 1.5, f"three concurrent 'sleep 1' took {elapsed:.2f}s"
    slow = threading.Thread(target=vm.exec, args=("sleep 2",))
    slow.start()
    try:
        time.sleep(0.2)
        assert _elapsed(lambda: vm.read_file("/etc/hostname")) < 1.0, "read_file waited behind an exec"
        assert _elapsed(lambda: vm.write_file("/tmp/w", "w")) < 1.0, "write_file waited behind an exec"
    finally:
        slow.join()


def test_concurrent_calls_never_cross_talk(vm: VM) -> None:
    results: dict[int, tuple[str, str]] = {}

    def run(i: int) -> None:
        r = vm.exec(f"for n in $(seq 1 300); do echo out-{i}-$n; echo err-{i}-$n >&2; done", check=True)
        results[i] = (r.stdout, r.stderr)

    _in_threads([lambda i=i: run(i) for i in range(8)])  # type: ignore[misc]
    for i, (out, err) in results.items():
        assert out == "".join(f"out-{i}-{n}\n" for n in range(1, 301))
        assert err == "".join(f"err-{i}-{n}\n" for n in range(1, 301))


def _in_threads(calls: list[Callable[[], object]]) -> None:
    errors: list[BaseException] = []

    def wrap(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


# --------------------------------------------------------------------------- async


def test_aio_gather_runs_concurrently(vm: VM) -> None:
    async def main() -> list[str]:
        results = await asyncio.gather(*(vm.aio.exec(f"sleep 1; echo {i}") for i in range(3)))
        return [r.stdout for r in results]

    assert asyncio.run(main()) == ["0\n", "1\n", "2\n"]
    elapsed = _best_of_two(lambda: asyncio.run(main()))
    assert elapsed < 1.5, f"three gathered 'sleep 1' took {elapsed:.2f}s"


def test_aio_cancel_kills_the_guest_command(vm: VM) -> None:
    async def main() -> None:
        task = asyncio.ensure_future(vm.aio.exec("echo $$ > /tmp/cancel-me; exec sleep 60"))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if vm.exec("test -s /tmp/cancel-me").exit_code == 0:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    # In the transcript from the moment it was sent, whether or not its thread has returned yet.
    (entry,) = [e for e in vm.transcript if e.command == "echo $$ > /tmp/cancel-me; exec sleep 60"]
    pid = vm.read_file("/tmp/cancel-me").decode().strip()
    deadline = time.monotonic() + 10
    while vm.exec(f"test -d /proc/{pid}").exit_code == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert vm.exec(f"test -d /proc/{pid}").exit_code != 0, "the cancelled command still runs in the guest"
    while entry.started is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert entry.cancelled and entry.render().startswith(f"$ {entry.command}    [CANCELLED, exit ")


def test_aio_files_and_output_in_the_loop_thread(vm: VM, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("a\n")

    async def main() -> None:
        await vm.aio.write_file("/work/x.txt", "x\n")
        assert await vm.aio.read_file("/work/x.txt") == b"x\n"
        await vm.aio.copy_in(tmp_path / "in", "/work/in")
        out = await vm.aio.copy_out("/work/in", tmp_path / "out")
        assert (out / "a.txt").read_text() == "a\n"
        with pytest.raises(FileNotFoundError):
            await vm.aio.read_file("/work/missing")
        loop_thread = threading.get_ident()
        threads: set[int] = set()
        r = await vm.aio.exec("echo one; echo two >&2", on_output=lambda s, d: threads.add(threading.get_ident()))
        assert r.stdout == "one\n" and threads == {loop_thread}

    asyncio.run(main())


def test_aio_under_anyio_on_each_of_its_backends(vm: VM) -> None:
    import anyio  # both in the test extra: a missing one fails here rather than skipping trio's half

    backends = ["asyncio", "trio"]

    async def main() -> float:
        started = time.monotonic()
        async with anyio.create_task_group() as group:
            for _ in range(3):
                # exec is a coroutine function, typed as returning an Awaitable: anyio's asks a Coroutine
                group.start_soon(vm.aio.exec, "sleep 1")  # type: ignore[arg-type]
        with anyio.move_on_after(0.5):
            await vm.aio.exec("echo $$ > /tmp/anyio-cancel; exec sleep 60")
        return time.monotonic() - started

    for backend in backends:
        elapsed = anyio.run(main, backend=backend)
        assert elapsed < 2.2, f"{backend}: {elapsed:.2f}s"
        pid = vm.read_file("/tmp/anyio-cancel").decode().strip()
        deadline = time.monotonic() + 10
        while vm.exec(f"test -d /proc/{pid}").exit_code == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert vm.exec(f"test -d /proc/{pid}").exit_code != 0, f"{backend}: the cancelled command survived"


def test_aio_under_a_trio_too_old_says_what_to_install(vm: VM, monkeypatch: pytest.MonkeyPatch) -> None:
    import trio

    async def main() -> None:
        await vm.aio.exec("true")

    monkeypatch.setattr(trio, "__version__", "0.22.2")  # before abandon_on_cancel= (0.23)
    with pytest.raises(RuntimeError, match=r"needs trio>=0\.23, and trio 0\.22\.2 is installed: pip install -U trio"):
        trio.run(main)
