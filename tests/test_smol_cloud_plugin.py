"""The plugin on the smol backend, end to end: real pytest runs, the real SDK, the loopback cloud.

``--smol-backend=smol --smol-target=cloud --smol-baseline=alpine`` against ``tests/smolcloud``
(its machines are namespace guests, so this runs on any Linux host). Each test has its own
API token: the server keeps each token's machines apart, so "nothing left" is per test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_smolvm.host import registry
from tests import tools
from tests.smolcloud.harness import ROOT, LoopbackCloud

pytest.importorskip("smol")
SMOL = ["--smol-backend=smol", "--smol-target=cloud", "--smol-baseline=alpine", "-p", "no:cacheprovider"]
EXAMPLES = ROOT / "examples"


def machines(cloud: LoopbackCloud, token: str) -> list[dict[str, object]]:
    return [m for m in cloud.machines() if m["owner"] == token]


def run_cli(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy())


# -n 2 only: the serial half of both already runs in this session (tests/backends' smol-cloud
# params, the cloud tests below); -n 2 adds the plan service and shared machines across workers.
@pytest.mark.parametrize("workers", [["-n", "2"]], ids=["n2"])
def test_example_suite_runs_on_smol_cloud(pytester: pytest.Pytester, cloud: LoopbackCloud, token: str,
                                          workers: list[str]) -> None:
    shutil.copytree(EXAMPLES, pytester.path / "examples")
    # The network example's stand-in index is a namespace on this host: a cloud machine is not
    # on this host, so it could never reach it (that example is the namespace backend's NAT's).
    result = pytester.runpytest_subprocess("examples", "--ignore=examples/network", *SMOL, *workers)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 10 and set(outcomes) <= {"passed", "warnings"}, result.stdout.str()
    result.stdout.fnmatch_lines(["smolvm: backend smol (isolation: microvm*"])
    assert cloud.wait_for_no_machines(token=token) == []
    history = cloud.history(token)
    creates = [h for h in history if h["op"] == "create"]
    branches = [h for h in history if h["op"] == "branch"]
    # One warm source per distinct spec, made once for the run (under -n 2 by the controller,
    # which outlives the workers): every test's guest is a branch of it.
    assert len(creates) == len({h["request"]["labels"]["key"] for h in creates}), creates
    assert len({h["request"]["labels"]["owner_pid"] for h in creates}) == 1  # one process made them all
    assert len(branches) >= outcomes["passed"] - 5
    # Branches of a source, or (examples/test_branching.py: vm.branch) of a guest branched from one.
    assert {b["source"] for b in branches} <= {c["id"] for c in creates} | {b["id"] for b in branches}
    for create in creates:  # what the plugin asks of the cloud for every source
        request = create["request"]
        assert request["forkable"] is True and request["ttlSeconds"] == 3600
        assert request["source"] == {"type": "image", "reference": "alpine"}
        assert request["labels"]["pytest-smolvm"] == "1" and request["labels"]["owner_host"]


@pytest.mark.parametrize("workers", [["-n", "2"]], ids=["n2"])  # serial: tests/backends runs it in-session
def test_conformance_suite_runs_against_the_same_server(cloud: LoopbackCloud, token: str,
                                                        workers: list[str]) -> None:
    """tests/backends' smol-cloud half, with the plugin's smol options, on a server we check after."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/backends", "-k", "smol-cloud", "-q", *SMOL,
                           *workers, "-W", "ignore::pytest.PytestUnraisableExceptionWarning"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
    assert cloud.wait_for_no_machines(token=token) == []
    assert cloud.history(token), "the conformance suite did not use the server it was pointed at"


def test_network_off_open_and_allow_hosts_reach_the_cloud_as_asked(
        pytester: pytest.Pytester, cloud: LoopbackCloud, token: str) -> None:
    # The loopback cloud runs its machines as namespace guests: network=True is pasta's NAT there
    # (without it, the open machine never becomes ready and the run waits out the SDK's timeout).
    tools.require("pasta", "the loopback cloud's machine with the network open")
    tools.require("nft", "the loopback cloud's machine with the network open")
    pytester.makepyfile(test_net="""
        import pytest

        def test_off(smol_vm):
            assert smol_vm.exec("ip -o link | grep -vc ': lo:'").stdout.strip() == "0"

        @pytest.mark.smol(network=True)
        def test_open(smol_vm):
            pass

        @pytest.mark.smol(allow_hosts=["pypi.org", "files.pythonhosted.org"])
        def test_allow(smol_vm):
            # the loopback cloud cannot enforce a list: it fails closed, with no network at all
            assert smol_vm.exec("ip -o link | grep -vc ': lo:'").stdout.strip() == "0"
    """)
    result = pytester.runpytest_subprocess(*SMOL)
    result.assert_outcomes(passed=3)
    networks = sorted(str(h["request"].get("network")) for h in cloud.history(token) if h["op"] == "create")
    assert networks == sorted([str({"mode": "blocked"}), str({"mode": "open"}), str(
        {"mode": "allowCidrs", "cidrs": [], "hosts": ["pypi.org", "files.pythonhosted.org"]})])
    assert cloud.wait_for_no_machines(token=token) == []


def test_allow_hosts_never_asks_for_network_off_alongside_the_list(token: str) -> None:
    from smol.transport import _native_config, resolve_network

    from pytest_smolvm.backends.base import BackendOptions, VMSpec
    from pytest_smolvm.backends.smol.backend import SmolBackend
    from pytest_smolvm.baselines.baseline import Baseline

    backend = SmolBackend(BackendOptions(target="cloud"))
    image = Baseline("alpine", "registry", None, "alpine")
    allow = backend.machine_config("n", "k", VMSpec("n", image, allow_hosts=("pypi.org",)))
    assert resolve_network(allow) is None and allow.resources is not None
    assert allow.resources.allow_hosts == ["pypi.org"]
    # what the local engine would be sent: the list, and no "network: false" beside it
    assert "network" not in _native_config("n", allow)["resources"]
    off = backend.machine_config("n", "k", VMSpec("n", image))
    assert resolve_network(off) is False


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "n2"])
def test_keep_failed_keeps_the_failed_guest_for_the_shell(pytester: pytest.Pytester, cloud: LoopbackCloud,
                                                          token: str, workers: list[str]) -> None:
    pytester.makepyfile(test_keep="""
        def test_passes(smol_vm):
            smol_vm.exec("echo fine > /root/evidence", check=True)

        def test_fails(smol_vm):
            smol_vm.exec("mkdir -p /root/case && echo evidence > /root/case/evidence", check=True)
            assert False, "keep me"
    """)
    result = pytester.runpytest_subprocess(*SMOL, "--smol-keep=failed", *workers)
    result.assert_outcomes(passed=1, failed=1)
    kept = [r for r in registry.records() if r.kept]
    assert len(kept) == 1 and kept[0].test_id.endswith("test_fails"), kept
    # the kept branch and the source it needs; the passing test's guest is gone
    assert len(machines(cloud, token)) == 2
    name = kept[0].name
    once = run_cli("shell", name, "cat", "/root/case/evidence")
    assert (once.returncode, once.stdout) == (0, "evidence\n"), once.stderr
    lines = run_cli("shell", name, stdin="cd /root/case\ncat evidence; pwd\nexit 3\n")
    assert lines.stdout == "evidence\n/root/case\n", lines.stderr
    assert run_cli("shell", name, "false").returncode == 1
    reaped = run_cli("reap", "--kept")
    assert reaped.returncode == 0, reaped.stderr
    assert cloud.wait_for_no_machines(token=token) == []
    assert list(registry.records()) == []


def test_a_killed_run_leaves_labelled_machines_that_reap_removes(
        pytester: pytest.Pytester, cloud: LoopbackCloud, token: str) -> None:
    marker = pytester.path / "started"
    pytester.makepyfile(test_hang=f"""
        import pathlib, time

        def test_hangs(smol_vm):
            pathlib.Path({str(marker)!r}).write_text("x")
            time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *SMOL, "-p", "no:cacheprovider"], cwd=pytester.path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the test never started"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    left = machines(cloud, token)
    assert len(left) == 2  # the source and the test's branch, both still on the cloud
    for machine in left:
        labels = machine["labels"]
        assert isinstance(labels, dict) and labels["owner_pid"] == str(proc.pid)
    reaped = run_cli("reap")
    assert reaped.returncode == 0, reaped.stderr
    assert cloud.wait_for_no_machines(token=token) == []


def test_ttl_is_the_last_line_of_defence(pytester: pytest.Pytester, tmp_path: Path, smol_state: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody reaps a killed run here: the TTL the plugin set removes its machines by itself."""
    fast = LoopbackCloud("--ttl-scale", "0.002", state_dir=tmp_path / "state")  # an hour in 7.2 s
    try:
        for key, value in fast.env().items():
            monkeypatch.setenv(key, value)
        marker = pytester.path / "started"
        pytester.makepyfile(test_hang=f"""
            import pathlib, time

            def test_hangs(smol_vm):
                pathlib.Path({str(marker)!r}).write_text("x")
                time.sleep(300)
        """)
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *SMOL], cwd=pytester.path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env=os.environ.copy())
        try:
            deadline = time.monotonic() + 60
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert marker.exists()
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert fast.machines(), "the run's machines were gone before their TTL"
        assert fast.wait_for_no_machines(timeout=30) == []
        for record in registry.records():  # what the dead run recorded, for smol_state's leak check
            record.remove()
    finally:
        status, err = fast.stop()
    assert status == 0, err


def test_retryable_provisioning_errors_are_retried(pytester: pytest.Pytester, tmp_path: Path,
                                                  smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flaky = LoopbackCloud("--fail", "branch:1:503", "--fail", "branch:3:429:1", state_dir=tmp_path / "state")
    try:
        for key, value in flaky.env().items():
            monkeypatch.setenv(key, value)
        pytester.makepyfile(test_two="""
            def test_one(smol_vm):
                assert smol_vm.exec("echo ok").stdout == "ok\\n"

            def test_two(smol_vm):
                assert smol_vm.exec("echo ok").stdout == "ok\\n"
        """)
        result = pytester.runpytest_subprocess(*SMOL)
        result.assert_outcomes(passed=2)
        fired = [(f["operation"], f["status"]) for f in flaky.admin("faults")["fired"]]
        assert fired == [("branch", 503), ("branch", 429)]
        # the 503 cost the plugin one more attempt (a new name); the SDK resent the 429 itself
        assert len([h for h in flaky.history() if h["op"] == "branch"]) == 2
        assert flaky.wait_for_no_machines() == []
    finally:
        status, err = flaky.stop()
    assert status == 0, err


def test_a_failed_delete_is_retried_not_forgotten(pytester: pytest.Pytester, tmp_path: Path,
                                                  smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = LoopbackCloud("--fail", "delete:1:500", state_dir=tmp_path / "state")
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        pytester.makepyfile(test_one="""
            def test_one(smol_vm):
                smol_vm.exec("true", check=True)
        """)
        result = pytester.runpytest_subprocess(*SMOL)
        result.assert_outcomes(passed=1)
        assert [f["operation"] for f in server.admin("faults")["fired"]] == ["delete"]
        assert server.wait_for_no_machines() == [], "the machine whose first delete failed leaked"
    finally:
        status, err = server.stop()
    assert status == 0, err


def test_warm_baseline_hook_runs_once_per_host_under_n2(pytester: pytest.Pytester, cloud: LoopbackCloud,
                                                        token: str) -> None:
    ran = pytester.path / "hook-ran"
    pytester.makeconftest(f"""
        import os

        def pytest_smolvm_prepare_baseline(vm, config):
            with open({str(ran)!r}, "a") as f:
                f.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")
            vm.exec("mkdir -p /opt/warm && echo prepared > /opt/warm/marker", check=True)
    """)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(8))
        def test_inherits(smol_vm, i):
            assert smol_vm.read_file("/opt/warm/marker") == b"prepared\\n"
            smol_vm.write_file("/opt/warm/marker", f"changed by {i}")  # never seen by another test
    """)
    pytester.runpytest_subprocess(*SMOL, "-n", "2").assert_outcomes(passed=8)
    assert len(ran.read_text().splitlines()) == 1, ran.read_text()
    history = cloud.history(token)
    creates = [h for h in history if h["op"] == "create"]
    branched_from = {h["source"] for h in history if h["op"] == "branch"}
    assert len(branched_from) == 1 and branched_from <= {h["id"] for h in creates}  # one warm source
    assert len(creates) == 1, creates  # and no idle cold one beside it
    assert len({h["request"]["labels"]["owner_pid"] for h in creates}) == 1  # made by the controller
    assert cloud.wait_for_no_machines(token=token) == []


def test_concurrent_episodes_branch_in_batches(pytester: pytest.Pytester, cloud: LoopbackCloud, token: str) -> None:
    pytester.makepyfile(test_fanout="""
        import asyncio
        import pytest

        ARRIVED = set()

        @pytest.mark.smol_episodes(8, concurrency=8)
        async def test_fanout(smol_vm, smol_episode):
            ARRIVED.add(smol_episode.index)  # all eight in flight at once, each in its own branch
            while len(ARRIVED) < 8:
                await asyncio.sleep(0.05)
            assert (await smol_vm.aio.exec("echo up")).stdout == "up\\n"
    """)
    pytester.runpytest_subprocess(*SMOL, "-p", "no:anyio").assert_outcomes(passed=8)
    assert cloud.wait_for_no_machines(token=token) == []
    branches = [h for h in cloud.history(token) if h["op"] == "branch"]
    assert len(branches) == 8
    # The first guest is made alone (the run's decision); the other seven, asked for at once,
    # are coalesced into branch_batch calls: fewer calls than guests.
    assert len({h["call"] for h in branches}) < 8, branches
