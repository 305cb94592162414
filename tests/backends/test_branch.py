"""Branching a running guest: vm.branch, vm.branch_batch, vm.reward (issue 45; docs/reference.md).

On the namespace backend a child gets its parent's files as they are at the branch (the parent
frozen while its upper layer is copied), not its processes. Children are the owner's guests:
recorded with their parent named, destroyed with the owner on every path, nothing left on the host.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_smolvm import ProvisionError, Session, UsageError
from pytest_smolvm.backends.base import branching
from pytest_smolvm.backends.namespace import branch as nsbranch
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.backends.namespace.guest import NamespaceGuest
from pytest_smolvm.errors import GuestError
from pytest_smolvm.evals.lines import read_results
from pytest_smolvm.host.procs import is_alive
from pytest_smolvm.host.registry import records
from pytest_smolvm.session.pool import READY_TEST_ID
from tests.leaks import assert_host_clean

pytestmark = pytest.mark.skipif(not NamespaceBackend.probe().available, reason=NamespaceBackend.probe().reason)


def _ours() -> list[str]:
    return sorted(r.name for r in records() if r.test_id != READY_TEST_ID)


def _gone(name: str, timeout: float = 10.0) -> None:
    """Session.destroy hands the guest to a background destroy: its record goes when that ends."""
    deadline = time.monotonic() + timeout
    while name in _ours():
        assert time.monotonic() < deadline, f"{name} was not destroyed within {timeout}s"
        time.sleep(0.02)


def test_a_child_sees_the_parent_as_it_was_then_each_goes_its_own_way(smol_state: Path) -> None:
    with Session(backend="namespace") as session:
        parent = session.create("episode")
        parent.exec("mkdir -p /w/d && echo before > /w/d/f && rm /etc/hostname && "
                    "rm -rf /etc/apk && mkdir /etc/apk && echo x > /etc/apk/mine", check=True)
        parent.exec("sleep 300 >/dev/null 2>&1 &", check=True)
        child = parent.branch()
        assert child.name != parent.name
        assert child.read_file("/w/d/f") == b"before\n"
        assert child.exec("test -e /etc/hostname").exit_code == 1, "a deletion in the parent is carried"
        assert child.exec("ls /etc/apk").stdout == "mine\n", "a dir made anew hides the baseline's (opaque)"
        assert "sleep" not in child.exec("ps -o comm").stdout, "processes are not carried"
        assert "not its processes" in child.logs()  # said once, in the child's log
        parent.write_file("/w/d/f", "parent after")
        child.write_file("/w/d/f", "child after")
        child.write_file("/w/child-only", "x")
        assert parent.read_file("/w/d/f") == b"parent after"
        assert child.read_file("/w/d/f") == b"child after"
        assert parent.exec("test -e /w/child-only").exit_code == 1
        assert "sleep" in parent.exec("ps -o comm").stdout, "the parent runs on after the branch"
        (record,) = [r for r in records() if r.name == child.name]
        assert record.parent == parent.name and record.test_id == "library:episode"
    assert_host_clean(smol_state)
    assert list(records()) == []


def test_branch_batch_children_are_independent_and_a_branch_of_a_branch_works(smol_state: Path) -> None:
    with Session(backend="namespace") as session:
        parent = session.create()
        parent.write_file("/w/shared", "0")
        parent.write_file("/w/untouched", "from the first generation")
        kids = parent.branch_batch(3)
        assert len({k.name for k in kids}) == 3
        for i, kid in enumerate(kids):
            kid.exec(f"echo {i} >> /w/shared; echo {i} > /w/mine; echo {i} > /w/late", check=True)
        assert [k.read_file("/w/shared") for k in kids] == [b"0" + f"{i}\n".encode() for i in range(3)]
        assert [k.exec("cat /w/mine").stdout for k in kids] == ["0\n", "1\n", "2\n"]
        assert parent.read_file("/w/shared") == b"0"
        grandchild = kids[1].branch()
        assert grandchild.read_file("/w/mine") == b"1\n" and grandchild.read_file("/w/shared") == b"01\n"
        session.destroy(kids[1])  # its own copies: the grandchild keeps every generation's files
        _gone(kids[1].name)
        assert grandchild.read_file("/w/shared") == b"01\n"
        assert grandchild.exec("cat /w/late").stdout == "1\n"  # first looked up now
        assert grandchild.read_file("/w/untouched") == b"from the first generation"  # its grandparent's
        assert len(_ours()) == 4
        with pytest.raises(ValueError, match=r"vm.branch_batch: n must be an integer from 1 to 64, got 0"):
            parent.branch_batch(0)
        for wrong in (True, 2.0, "2"):  # True was a ValueError, as if 1 were out of range
            with pytest.raises(TypeError, match=r"vm.branch_batch: n must be an integer from 1 to 64, got "):
                parent.branch_batch(wrong)  # type: ignore[arg-type]
    assert_host_clean(smol_state)


def test_reward_runs_in_a_throwaway_branch_and_leaves_the_episode_untouched(smol_state: Path) -> None:
    with Session(backend="namespace") as session:
        episode = session.create()
        episode.write_file("/w/answer", "42")
        before = _ours()
        result = episode.reward("cat /w/answer; echo graded > /w/answer; rm -rf /w; sleep 300 &")
        assert result.stdout == "42" and result.exit_code == 0
        assert episode.read_file("/w/answer") == b"42"
        assert _ours() == before, "the grader's branch is gone right after"
        timed_out = episode.reward("sleep 30", timeout=0.5)
        assert timed_out.timed_out
        with pytest.raises(Exception, match="exit"):
            episode.reward("exit 3", check=True)
        assert _ours() == before
        assert "reward" not in episode.transcript_text(), "the grader's commands are not the episode's"
    assert_host_clean(smol_state)


def test_the_async_twins(smol_state: Path) -> None:
    async def main(session: Session) -> None:
        vm = await session.acreate()
        await vm.aio.write_file("/w/x", "1")
        child = await vm.aio.branch()
        kids = await vm.aio.branch_batch(2)
        graded = await vm.aio.reward("cat /w/x; echo 2 > /w/x")
        assert graded.stdout == "1"
        assert [await k.read_file("/w/x") for k in (child, *kids)] == [b"1"] * 3
        assert (await (await kids[0].branch()).exec("cat /w/x")).stdout == "1"
        assert await vm.aio.read_file("/w/x") == b"1"

    with Session(backend="namespace") as session:
        asyncio.run(main(session))
    assert_host_clean(smol_state)


def test_a_batch_that_fails_halfway_leaves_none(smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = NamespaceBackend.create
    calls: list[object] = []
    made: list[NamespaceGuest] = []

    def flaky(self: NamespaceBackend, spec: object, **kw: object) -> object:
        if kw.get("layers"):
            calls.append(spec)
            if len(calls) == 2:
                raise ProvisionError("injected: the second child could not be made")
            made.append(real(self, spec, **kw))  # type: ignore[arg-type]
            return made[-1]
        return real(self, spec, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(NamespaceBackend, "create", flaky)
    with Session(backend="namespace") as session:
        parent = session.create()
        parent.write_file("/w/x", "1")
        before = _ours()
        with pytest.raises(ProvisionError, match="injected"):
            parent.branch_batch(3)
        assert _ours() == before
        assert len(made) == 1 and not is_alive(made[0].pid, made[0].pid_start), "the child made was destroyed"
        assert not list((smol_state / "layers").iterdir())
        assert parent.read_file("/w/x") == b"1", "the parent is thawed and well"
    assert_host_clean(smol_state)


def test_max_vms_counts_children(smol_state: Path) -> None:
    with Session(backend="namespace", max_vms=2) as session:
        parent = session.create()
        with pytest.raises(UsageError, match=r"branch_batch\(2\): 2 children and their parent need 3 guests, "
                                             r"more than --smol-max-vms=2"):
            parent.branch_batch(2)
        assert parent.branch().exec("true").exit_code == 0
    assert_host_clean(smol_state)


def test_a_backend_without_the_capability_says_so() -> None:
    class Plain:
        name = "plain"

    with pytest.raises(UsageError, match=r"vm\.branch: the plain backend cannot branch a running guest"):
        branching(Plain())


# ---------------------------------------------------------------------- hostile parents and children


def test_a_parent_that_keeps_writing_is_copied_at_one_instant(smol_state: Path) -> None:
    """Ten files written in turn with one counter: a copy of one instant holds i..i then i-1..i-1.
    Without the freeze the copy reads some files later than others (a later file newer)."""
    with Session(backend="namespace") as session:
        parent = session.create()
        parent.write_file("/w/.keep", "")
        parent.exec("(i=0; while :; do i=$((i+1)); for n in 0 1 2 3 4 5 6 7 8 9; do "
                    "echo $i > /w/f$n.tmp && mv /w/f$n.tmp /w/f$n; done; done) >/dev/null 2>&1 &", check=True)
        parent.exec("while [ ! -e /w/f9 ]; do sleep 0.01; done", check=True, timeout=10)
        for _ in range(6):
            (child,) = parent.branch_batch(1)
            values = [int(v) for v in child.exec("cat /w/f0 /w/f1 /w/f2 /w/f3 /w/f4 /w/f5 /w/f6 /w/f7 /w/f8 "
                                                 "/w/f9").stdout.split()]
            top = values[0]
            assert all(v in (top, top - 1) for v in values) and values == sorted(values, reverse=True), values
            session.destroy(child)
            _gone(child.name)
        counter = int(parent.read_file("/w/f0"))
        parent.exec("sleep 0.2")
        assert int(parent.read_file("/w/f0")) > counter, "the parent runs again after each branch"
    assert_host_clean(smol_state)


def test_links_and_special_files_are_copied_as_themselves_never_followed(smol_state: Path, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.write_text("host")
    os.chmod(tmp_path, 0o755)
    with Session(backend="namespace") as session:
        parent = session.create()
        parent.exec(f"mkdir -p /w && ln -s {canary} /w/to-host && ln -s / /w/root-link && "
                    "echo one > /w/a && ln /w/a /w/a-hard && mkfifo /w/fifo && "
                    "(mknod /w/null c 1 3 2>/dev/null; true) && "
                    "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/w/sock\")' 2>/dev/null; "
                    "mkdir -p /w/deep && cd /w/deep && ln -s ../../../../../../../.. up", check=True)
        child = parent.branch()
        assert child.exec("readlink /w/to-host").stdout.strip() == str(canary)
        assert child.exec("test -L /w/root-link && test -p /w/fifo").exit_code == 0
        assert child.exec("stat -c %h /w/a").stdout.strip() == "2", "hard links stay linked"
        assert child.read_file("/w/a-hard") == b"one\n"  # (a write copies one up: overlay's lower-layer links)
        assert child.exec("test -c /w/null").exit_code == 1, "no device node reaches a child"
        assert child.exec("test -S /w/sock").exit_code == 1
        assert canary.read_text() == "host"
        child.exec("echo pwned > /w/to-host 2>/dev/null; true")
        assert canary.read_text() == "host"
    assert_host_clean(smol_state)


def test_a_child_cannot_reach_its_parent_or_its_siblings(smol_state: Path) -> None:
    with Session(backend="namespace") as session:
        parent = session.create()
        parent.write_file("/w/shared", "original")
        a, b = parent.branch_batch(2)
        # Their lower layers share inodes (hard links): a write must copy up, never reach b's.
        a.exec("echo from-a >> /w/shared; chmod 777 /w/shared; touch -d 2001-01-01 /w/shared", check=True)
        assert b.read_file("/w/shared") == b"original" and parent.read_file("/w/shared") == b"original"
        assert b.exec("stat -c %a /w/shared").stdout.strip() != "777"
        mounts = a.read_file("/proc/self/mountinfo").decode()
        assert "layers" not in mounts and parent.name not in mounts and b.name not in mounts
        found = a.exec(f"grep -rl original / --exclude-dir=proc --exclude-dir=sys 2>/dev/null | grep -v '^/w/'; "
                       f"ls /proc/*/root/w 2>/dev/null | grep -c {b.name}", timeout=60)
        assert found.stdout.strip() in ("", "0"), found.stdout
    assert_host_clean(smol_state)


def test_too_deep_a_tree_fails_closed_and_leaves_nothing(smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nsbranch, "MAX_DEPTH", 8)
    with Session(backend="namespace") as session:
        parent = session.create()
        parent.exec("mkdir -p /w/1/2/3/4/5/6/7/8/9/10/11", check=True)
        before = _ours()
        with pytest.raises((GuestError, ProvisionError), match="nest deeper than 8 directories"):
            parent.branch()
        assert _ours() == before and not list((smol_state / "layers").iterdir())
        assert parent.exec("true").exit_code == 0
    assert_host_clean(smol_state)


# ---------------------------------------------------------------------- the fixture's path


def test_children_of_passing_failing_erroring_and_timed_out_tests_are_destroyed(
        pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import time
        import pytest

        @pytest.fixture
        def branched_then_broken(smol_vm):
            smol_vm.branch_batch(2)
            raise RuntimeError("setup broke after branching")

        def test_pass(smol_vm):
            smol_vm.write_file("/w/x", "1")
            kid = smol_vm.branch()
            assert kid.branch().read_file("/w/x") == b"1"

        def test_fail(smol_vm):
            smol_vm.branch_batch(2)
            assert False

        def test_error(branched_then_broken):
            pass

        @pytest.mark.timeout(3)
        def test_timeout(smol_vm):
            smol_vm.branch()
            time.sleep(30)

        def test_zz_none_of_them_outlived_its_test(smol_vm):
            from pytest_smolvm.host.registry import records
            deadline = time.monotonic() + 10
            while True:  # (destroys run in the background: a record goes when its destroy ends)
                alive = [r.name for r in records() if r.test_id != "(made ahead for the next test)"]
                if alive == [smol_vm.name] or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert alive == [smol_vm.name]
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "--smol-results=results.jsonl")
    result.assert_outcomes(passed=2, failed=2, errors=1)
    lines = {line["function"].split("::")[-1]: line for line in read_results(pytester.path / "results.jsonl")}
    passed = lines["test_pass"]
    (parent, kid, grandkid) = passed["vms"]  # each child named with its parent in the results line
    assert passed["branches"] == {kid: parent, grandkid: kid}
    assert "branches" not in lines["test_zz_none_of_them_outlived_its_test"]
    assert_host_clean(smol_state)
    assert list(records()) == []


def test_a_crashed_owner_leaves_no_branch_behind(smol_state: Path, tmp_path: Path) -> None:
    """SIGKILL of the process that made a parent and its branches: the helper it leaves behind
    removes every guest, the branches' copied layers included (no reaper needed)."""
    script = tmp_path / "crash.py"
    script.write_text(f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from pytest_smolvm import Session
session = Session(backend="namespace")
parent = session.create()
parent.write_file("/w/x", "1")
parent.branch_batch(2)[0].branch()
os.kill(os.getpid(), signal.SIGKILL)
""")
    proc = subprocess.run([sys.executable, str(script)], timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert_host_clean(smol_state, timeout=10)
    assert list(records()) == []


def test_the_reaper_destroys_branches_before_their_parents(smol_state: Path) -> None:
    from pytest_smolvm.host import registry

    for name, parent in [("a-parent", None), ("b-grandchild", "c-child"), ("c-child", "a-parent"), ("d-other", None)]:
        record = registry.Record.for_this_process(name, "namespace", "run", "main", "t")
        record.parent = parent
        record.save()
    order: list[str] = []
    registry.reap(lambda record: True, lambda record: order.append(record.name))
    assert order.index("b-grandchild") < order.index("c-child") < order.index("a-parent")
    assert list(records()) == []


def test_the_reaper_removes_a_branch_layer_by_its_record(tmp_path: Path) -> None:
    """``pytest-smolvm reap`` destroys by the record alone: a branch's layers go with its scratch dir."""
    from pytest_smolvm.backends.namespace.guest import destroy_recorded

    scratch = tmp_path / "scratch" / "smol-x-main-2"
    scratch.mkdir(parents=True)
    layer = tmp_path / "layers" / "smol-x-main-2" / "0"
    (layer / "d").mkdir(parents=True)
    (layer / "d" / "f").write_text("copied")
    (layer / "up").symlink_to(tmp_path)  # a link in the copy is removed, never followed
    destroy_recorded({"scratch": str(scratch), "cgroups": []})
    assert not scratch.exists() and not (tmp_path / "layers" / "smol-x-main-2").exists()
    assert (tmp_path / "layers").is_dir()
