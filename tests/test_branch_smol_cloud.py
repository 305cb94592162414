"""vm.branch on the smol backend through the loopback smol cloud: the real SDK's branch calls,
the engine's rules (a source must be started branchable; a parent goes after its branches)."""

from __future__ import annotations

import signal

import pytest

from pytest_smolvm.host import registry
from tests.smolcloud.harness import LoopbackCloud
from tests.waits import pytest_under_way

pytest.importorskip("smol")
SMOL = ["--smol-backend=smol", "--smol-target=cloud", "--smol-baseline=alpine", "-p", "no:cacheprovider"]


def test_branch_batch_and_reward_on_smol_cloud(pytester: pytest.Pytester, cloud: LoopbackCloud, token: str) -> None:
    pytester.makepyfile("""
        import asyncio
        import time
        import pytest

        @pytest.mark.smol(branchable=True)
        def test_children_see_the_parent_then_go_their_own_way(smol_vm):
            smol_vm.write_file("/w/x", "parent")
            child = smol_vm.branch()
            assert child.read_file("/w/x") == b"parent"
            child.write_file("/w/x", "child")
            assert smol_vm.read_file("/w/x") == b"parent"
            a, b = smol_vm.branch_batch(2)
            a.write_file("/w/x", "a")
            assert b.read_file("/w/x") == b"parent"
            grandchild = child.branch()
            assert grandchild.read_file("/w/x") == b"child"
            graded = smol_vm.reward("cat /w/x; echo graded > /w/x")
            assert graded.stdout == "parent" and smol_vm.read_file("/w/x") == b"parent"

        @pytest.mark.smol(branchable=True)
        def test_async_twins(smol_vm):
            async def main():
                kids = await smol_vm.aio.branch_batch(2)
                return [await k.exec("echo hi") for k in kids]
            assert [r.stdout for r in asyncio.run(main())] == ["hi\\n", "hi\\n"]

        @pytest.mark.smol(branchable=True)
        def test_failing_test_children_go(smol_vm):
            smol_vm.branch_batch(2)
            assert False

        @pytest.mark.smol(branchable=True)
        @pytest.mark.timeout(5)
        def test_timed_out_children_go(smol_vm):
            smol_vm.branch()
            time.sleep(60)

        def test_a_plain_guest_says_how_to_branch(smol_vm):
            with pytest.raises(Exception, match=r"not started branchable; mark its test "
                                                r"@pytest.mark.smol\\(branchable=True\\)"):
                smol_vm.branch()
    """)
    result = pytester.runpytest_subprocess(*SMOL, "-p", "no:randomly")
    result.assert_outcomes(passed=3, failed=2)
    calls = cloud.calls(token)
    assert any(key.endswith("/branches/batch") for key in calls), calls
    cloud.wait_for_no_machines(token=token)
    assert [r for r in registry.records()] == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_mid_test_deletes_a_whole_family(pytester: pytest.Pytester, cloud: LoopbackCloud, token: str,
                                               sig: signal.Signals) -> None:
    """A parent, its batch, a branch and a grandchild, then Ctrl-C: the engine deletes a parent
    only after its branches, and the run leaves no machine and no record."""
    started = pytester.path / "started"
    pytester.makepyfile(f"""
        import time
        from pathlib import Path
        import pytest

        @pytest.mark.smol(branchable=True)
        def test_long(smol_vm):
            smol_vm.branch_batch(2)
            smol_vm.branch().branch()
            Path({str(started)!r}).write_text("")
            time.sleep(120)
    """)
    proc = pytest_under_way(SMOL, pytester.path, started)
    assert len([m for m in cloud.machines() if m["owner"] == token]) >= 5
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "INTERNALERROR" not in out and "could not be destroyed" not in out, out
    assert [m for m in cloud.machines() if m["owner"] == token] == [], out
    assert list(registry.records()) == [], out
