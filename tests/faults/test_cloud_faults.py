"""The smol backend against a loopback smol cloud that fails mid-create: connections that close
with no answer, before the operation was done ("drop") or after it ("lost": the machine exists
and the client never heard of it).

Each run retries or errors clearly; afterwards the cloud holds no machine of the run's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.smolcloud.harness import LoopbackCloud

pytest.importorskip("smol")
SMOL = ["--smol-backend=smol", "--smol-target=cloud", "--smol-baseline=alpine", "-p", "no:cacheprovider"]


@contextlib.contextmanager
def cloud_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Iterator[LoopbackCloud]:
    """A loopback cloud started with ``args``, the environment pointed at it; after the body it
    must hold no machine and stop cleanly."""
    server = LoopbackCloud(*args, state_dir=tmp_path / "state")
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        yield server
        assert server.wait_for_no_machines() == [], f"{args}: machines left on the cloud"
    finally:
        status, err = server.stop()
    assert status == 0, err


def cloud_failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  *faults: str) -> contextlib.AbstractContextManager[LoopbackCloud]:
    """:func:`cloud_of_its_own` with ``--fail`` ``faults``."""
    return cloud_of_its_own(tmp_path, monkeypatch, *[arg for fault in faults for arg in ("--fail", fault)])


# (5xx answers to a branch are tests/test_smol_cloud_plugin.py's; a dropped connection
# is the SDK's to retry or fail, and a lost answer left the machine on the cloud until its TTL.)
@pytest.mark.parametrize("fault", ["create:1:503", "create:1:drop", "create:1:lost", "branch:1:drop", "branch:1:lost"])
def test_the_cloud_failing_mid_create(pytester: pytest.Pytester, tmp_path: Path, smol_state: Path,
                                      monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    with cloud_failing(tmp_path, monkeypatch, fault) as server:
        pytester.makepyfile("""
            def test_one(smol_vm):
                assert smol_vm.exec("echo ok").stdout == "ok\\n"

            def test_two(smol_vm):
                assert smol_vm.exec("echo ok").stdout == "ok\\n"
        """)
        result = pytester.runpytest_subprocess(*SMOL)
        fired = server.admin("faults")["fired"]
        assert [f["operation"] for f in fired] == [fault.split(":")[0]], fired
        outcomes = result.parseoutcomes()
        assert outcomes.get("passed", 0) + outcomes.get("error", 0) + outcomes.get("errors", 0) == 2, outcomes
        assert "INTERNALERROR" not in result.stdout.str()
        assert server.wait_for_no_machines() == [], f"{fault}: machines left on the cloud"
        # the next run, with the fault spent, is whole
        pytester.runpytest_subprocess(*SMOL).assert_outcomes(passed=2)


@pytest.mark.parametrize("faults", [["start:1:503"], [f"start:{n}:503" for n in range(1, 41)]],
                         ids=["one 503", "503 on every try"])
def test_a_503_on_a_machine_start_is_retried_or_ends_the_create_at_once(
        pytester: pytest.Pytester, tmp_path: Path, smol_state: Path, monkeypatch: pytest.MonkeyPatch,
        faults: list[str]) -> None:
    """The SDK's create swallowed a failed start and waited its whole readiness timeout (120 s):
    now the start is resent where the 503 says retry, and one that keeps failing ends the create
    (the machine deleted) with one clear error, well within a minute."""
    with cloud_failing(tmp_path, monkeypatch, *faults) as server:
        pytester.makepyfile("""
            def test_one(smol_vm):
                assert smol_vm.exec("echo ok").stdout == "ok\\n"
        """)
        result = pytester.runpytest_subprocess(*SMOL, timeout=60)
        fired = [f["operation"] for f in server.admin("faults")["fired"]]
        if len(faults) == 1:
            result.assert_outcomes(passed=1)
            assert fired == ["start"]
        else:
            result.assert_outcomes(errors=1)
            result.stdout.fnmatch_lines(["*could not start source pytest-smolvm-src-*injected failure of start*"])
            assert "INTERNALERROR" not in result.stdout.str()


@pytest.mark.parametrize(("fault", "limit"), [("branch:1:stall", "smol_call"), ("branch:1:unready", "smol_ready")],
                         ids=["never answered", "never ready"])
def test_a_branch_the_cloud_never_answers_or_readies_is_given_up_and_retried(
        pytester: pytest.Pytester, tmp_path: Path, smol_state: Path, monkeypatch: pytest.MonkeyPatch,
        fault: str, limit: str) -> None:
    """The SDK sends a branch with a 30-minute timeout, then waits 120 s for the clone to be ready,
    whatever its caller's bound: a control plane that never answered, or a clone stuck booting, held
    the test's setup that long. Now ``LIMITS.smol_call`` bounds the call and ``LIMITS.smol_ready``
    the wait (each lowered to 5 s here), the clone is deleted and the pool makes the guest again."""
    with cloud_failing(tmp_path, monkeypatch, fault) as server:
        pytester.makeconftest(f"""
            import dataclasses
            from pytest_smolvm import limits
            limits.LIMITS = dataclasses.replace(limits.LIMITS, {limit}=5.0)
        """)
        pytester.makepyfile("""
            def test_one(smol_vm):
                assert smol_vm.exec("echo ok").stdout == "ok\\n"
        """)
        result = pytester.runpytest_subprocess(*SMOL, timeout=60)  # the SDK alone waited 120 s
        result.assert_outcomes(passed=1)
        assert [f["operation"] for f in server.admin("faults")["fired"]] == ["branch"]


@pytest.mark.parametrize("call", ["branch()", "branch_batch(2)"])
def test_vm_branch_whose_clones_never_become_ready_fails_within_its_bound(
        pytester: pytest.Pytester, tmp_path: Path, smol_state: Path, monkeypatch: pytest.MonkeyPatch,
        call: str) -> None:
    """``vm.branch`` ran the SDK's branch with no bound at all (30 minutes for the answer, 120 s
    per clone for readiness): now it has the create's bounds, ends in one clear error, and the
    clones that never came up are deleted with the rest of the run's machines."""
    with cloud_failing(tmp_path, monkeypatch, "branch:2:unready") as server:  # 1: the guest itself
        pytester.makeconftest("""
            import dataclasses
            from pytest_smolvm import limits
            limits.LIMITS = dataclasses.replace(limits.LIMITS, smol_ready=5.0)
        """)
        pytester.makepyfile(f"""
            import time
            import pytest
            from pytest_smolvm import ProvisionError

            @pytest.mark.smol(branchable=True)
            def test_branch(smol_vm):
                began = time.monotonic()
                with pytest.raises(ProvisionError, match="could not branch"):
                    smol_vm.{call}
                assert time.monotonic() - began < 30
                assert smol_vm.exec("echo ok").stdout == "ok\\n"
        """)
        result = pytester.runpytest_subprocess(*SMOL, timeout=60)
        result.assert_outcomes(passed=1)
        assert [f["operation"] for f in server.admin("faults")["fired"]] == ["branch"]


def test_an_exec_its_node_never_times_out_is_killed_by_the_host(
        pytester: pytest.Pytester, tmp_path: Path, smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's resumable exec (1.37.3) has no deadline of its own: a node that never enforced
    ``timeoutSeconds`` held ``exec(timeout=1)`` until the command ended by itself. Now the host
    kills it (the exec's DELETE) once the timeout and its grace have passed."""
    with cloud_of_its_own(tmp_path, monkeypatch, "--untimed-execs") as server:
        pytester.makeconftest("""
            import dataclasses
            from pytest_smolvm import limits
            limits.LIMITS = dataclasses.replace(limits.LIMITS, smol_exec_cancel_grace=2.0)
        """)
        pytester.makepyfile("""
            import time

            def test_untimed(smol_vm):
                began = time.monotonic()
                result = smol_vm.exec("echo started; sleep 40", timeout=1)
                assert result.timed_out and result.exit_code == 124, result
                assert time.monotonic() - began < 15
                # the DELETE reached the node, which killed the command
                for _ in range(50):
                    if smol_vm.exec("pgrep -x sleep").exit_code != 0:
                        break
                    time.sleep(0.1)
                assert smol_vm.exec("pgrep -x sleep").exit_code != 0, "the command still runs"
        """)
        result = pytester.runpytest_subprocess(*SMOL, timeout=120)
        result.assert_outcomes(passed=1)
        calls = server.calls(server.token)
        assert calls.get("DELETE /v1/machines/{id}/execs/{exec}"), calls


def test_a_command_run_as_a_user_is_never_a_resumable_exec(
        pytester: pytest.Pytester, tmp_path: Path, smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1.37.3's resumable exec checks no user echo: a control plane that ignored ``user`` there
    ran ``exec(..., user="nobody")`` as root, silently. A user's command takes the plain exec,
    where the SDK checks that the user was applied."""
    with cloud_of_its_own(tmp_path, monkeypatch, "--execs-ignore-user") as server:
        pytester.makepyfile("""
            def test_as_nobody(smol_vm):
                assert smol_vm.exec("id -u", user="nobody").stdout == "65534\\n"
                smol_vm.exec("echo x > /tmp/mine", user="nobody", check=True)
                assert smol_vm.exec("stat -c %u /tmp/mine").stdout == "65534\\n"
                assert smol_vm.exec("id -u").stdout == "0\\n"  # the plugin's own commands stay resumable
        """)
        result = pytester.runpytest_subprocess(*SMOL, timeout=120)
        result.assert_outcomes(passed=1)
        calls = server.calls(server.token)
        assert calls.get("POST /v1/machines/{id}/execs") and calls.get("POST /v1/machines/{id}/exec"), calls

