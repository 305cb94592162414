"""The library API: guests without pytest, on the plugin's own lifecycle (docs/reference.md, Session)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_smolvm import MarkerError, Session, UsageError
from pytest_smolvm.errors import ClosedError
from pytest_smolvm.host.registry import records
from pytest_smolvm.session.pool import READY_TEST_ID
from tests.leaks import assert_host_clean, guest_processes

ROOT = Path(__file__).resolve().parents[1]


def test_a_session_makes_fresh_guests_and_destroys_them_all(smol_state: Path) -> None:
    with Session(backend="namespace") as session:
        a = session.create(env={"ROLE": "a"})
        b = session.create("episode-2")
        a.write_file("/tmp/secret", "a")
        assert b.exec(["test", "-e", "/tmp/secret"]).exit_code == 1  # each guest starts clean
        assert a.exec("echo $ROLE").stdout == "a\n"
        assert session.backend == "namespace"
        # (and the pool's guests made ahead for the next create, as in a pytest run)
        assert sorted(r.test_id for r in records() if r.test_id != READY_TEST_ID) == ["library", "library:episode-2"]
        session.destroy(a)
        with pytest.raises(UsageError, match=r"Session.destroy: smol-\S+ is not a live guest of this session"):
            session.destroy(a)
        with pytest.raises(UsageError, match=r"^Session.destroy: expected a VM this session made, got 'a'$"):
            session.destroy("a")  # type: ignore[arg-type]
        for label in (5, "two\nlines"):
            with pytest.raises(UsageError, match=r"^Session.create: label must be a one-line string"):
                session.create(label)  # type: ignore[arg-type]
        # closed means closed: the destroy runs in the background, but the handle refuses at once
        for call in (lambda: a.exec("true"), lambda: a.read_file("/tmp/secret"), a.branch):
            with pytest.raises(ClosedError, match=r"guest smol-\S+ is destroyed .*this handle takes no more calls"):
                call()
        assert "echo $ROLE" in a.transcript_text()  # what it did stays readable
    assert_host_clean(smol_state)  # b, left alive, went with the block
    assert list(records()) == []


def test_a_closed_session_leaves_no_unpacker_process_or_socket(smol_state: Path, tmp_path: Path) -> None:
    """copy_out starts this process's unpacker: a training loop that opens and closes sessions
    must find, after close, no child process and no socket of ours (in a process of its own,
    which starts with neither)."""
    script = tmp_path / "run.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from pytest_smolvm import Session

def children():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if ppid == os.getpid():
            found.append(cmdline)
    return found

def sockets():
    return sorted(os.readlink(f"/proc/self/fd/{{fd}}") for fd in os.listdir("/proc/self/fd")
                  if os.path.exists(f"/proc/self/fd/{{fd}}")
                  and os.readlink(f"/proc/self/fd/{{fd}}").startswith("socket"))

for round in range(2):
    with Session(backend="namespace") as session:
        vm = session.create()
        vm.exec("mkdir -p /out && echo hi > /out/f")
        vm.copy_out("/out", {str(tmp_path)!r} + f"/out{{round}}")
        assert any("untrusted.unpacker" in c for c in children()), children()
    print("children:", [c for c in children() if "unpacker" in c])
    print("sockets:", sockets())
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["children: []", "sockets: []"] * 2, done.stdout
    assert (tmp_path / "out1" / "f").read_text() == "hi\n"


def test_an_exception_in_the_block_still_destroys_every_guest(smol_state: Path) -> None:
    with pytest.raises(RuntimeError, match="the training loop broke"), Session(backend="namespace") as session:
        session.create()
        session.create()
        raise RuntimeError("the training loop broke")
    assert_host_clean(smol_state)


def test_close_with_keep_leaves_the_live_guests_running_as_kept(smol_state: Path) -> None:
    from pytest_smolvm.host.registry import reap
    from pytest_smolvm.session.reaper import destroy_record

    session = Session(backend="namespace")
    vm = session.create("inspect-me", memory_mb=256)  # its own disk (a loop device): nothing may hold it after
    vm.write_file("/tmp/state", "still here")
    session.close(keep=True)
    [kept] = [r for r in records() if r.name == vm.name]
    assert kept.kept and vm.exec("cat /tmp/state").stdout == "still here"
    assert reap(lambda r: r.kept, destroy_record).removed == [vm.name]  # what reap --kept does


def test_bad_keywords_are_one_line_errors_naming_them(smol_state: Path) -> None:
    with pytest.raises(UsageError, match=r"^Session\(backend\)=nope: unknown backend"):
        Session(backend="nope")
    with pytest.raises(UsageError, match=r"^Session\(keep='failed'\): a session has no test outcome"):
        Session(keep="failed")
    with pytest.raises(UsageError, match=r"^Session\(max_vms\)=0: expected a positive integer"):
        Session(max_vms=0)
    with Session(backend="namespace") as session:
        with pytest.raises(MarkerError, match=r"^Session.create\(memory_mb='lots'\): expected a positive integer"):
            session.create(memory_mb="lots")
        with pytest.raises(MarkerError, match=r"^Session.create: unknown keyword 'memroy_mb'"):
            session.create(memroy_mb=512)
    with pytest.raises(UsageError, match="the session is closed"):
        session.create()
    assert_host_clean(smol_state)


@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_async_sessions_make_guests_concurrently(smol_state: Path, library: str) -> None:
    async def main() -> list[str]:
        async with Session(backend="namespace") as session:
            vms = [await session.acreate(f"async-{i}") for i in range(3)]
            outputs = [(await vm.aio.exec(f"echo {i}")).stdout for i, vm in enumerate(vms)]
            await session.adestroy(vms[0])
            return outputs

    if library == "asyncio":
        outputs = asyncio.run(main())
    else:
        import trio

        outputs = trio.run(main)
    assert outputs == ["0\n", "1\n", "2\n"]
    assert_host_clean(smol_state)


OWNER = """
import sys, time
from pytest_smolvm import Session

session = Session(backend="namespace")
vm = session.create("doomed")
vm.exec("sleep 600 >/dev/null 2>&1 &")  # a guest process that would outlive nobody
print(vm.name, flush=True)
time.sleep(600)
"""


def test_a_killed_owner_s_guests_are_reaped_by_the_next_session(smol_state: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert owner.stdout is not None
        name = owner.stdout.readline().strip()
        assert name.startswith("smol-") and name in [r.name for r in records()]
        assert guest_processes(smol_state)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
    with Session(backend="namespace") as session:
        session.create()  # the session's one decision reaps what dead owners left
        assert [r.name for r in records() if r.name == name] == []
    assert_host_clean(smol_state)


ASYNC_TESTS = """
    import pytest

    async def test_plain_asyncio(smol_vm):
        r = await smol_vm.aio.exec("echo async")
        assert r.stdout == "async\\n"

    @pytest.mark.anyio
    async def test_anyio_runs_its_own(smol_vm, anyio_backend):
        assert (await smol_vm.aio.exec("echo " + anyio_backend)).stdout == anyio_backend + "\\n"

    async def test_without_a_guest_is_not_ours():
        pass
"""


@pytest.mark.parametrize("anyio_plugin", [True, False], ids=["with-anyio", "without-anyio"])
def test_async_guest_tests_need_no_async_plugin(pytester: pytest.Pytester, smol_state: Path,
                                                anyio_plugin: bool) -> None:
    pytester.makepyfile(ASYNC_TESTS)
    if anyio_plugin:
        result = pytester.runpytest_subprocess("-p", "anyio", "-rA")
        result.stdout.fnmatch_lines(["PASSED *test_anyio_runs_its_own[[]asyncio[]]*"])
        assert result.parseoutcomes()["failed"] == 1
    else:
        result = pytester.runpytest_subprocess("-p", "no:anyio", "-rA", "-k", "not anyio_runs_its_own")
        result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["PASSED *test_plain_asyncio*"])
    # pytest's own refusal, untouched, for an async test that asked for no guest
    result.stdout.fnmatch_lines(["FAILED *test_without_a_guest_is_not_ours*"])


def test_a_non_root_guest_user_can_write_dev_null(smol_state: Path) -> None:
    # /dev/null was made 0644 (mknod under the umask): `cmd > /dev/null` failed for every non-root user
    with Session(backend="namespace") as session:
        vm = session.create(user="nobody")
        done = vm.exec("echo x > /dev/null && echo written; stat -c %a /dev/null /dev/zero")
        assert done.stdout == "written\n666\n666\n", done
    assert_host_clean(smol_state)
