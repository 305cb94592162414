"""``pytest-smolvm doctor`` and the boot probe behind it, run for real on this host.

Whether a microVM boots here is decided independently (a probe boot), and the doctor must
agree: say so where one boots, otherwise explain why (the exit code says whether guests run at
all: test_first_run.py).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_smolvm.backends.smol import probe
from pytest_smolvm.backends.smol.boot_failures import plain_reason, pvm_evidence
from pytest_smolvm.backends.smol.doctor import run_doctor
from pytest_smolvm.backends.smol.sdk import remove_fork_lock, vm_data_dir

ROOT = Path(__file__).resolve().parents[1]


def _run_doctor(env_overrides: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(env_overrides)
    env["PYTEST_SMOLVM_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "pytest_smolvm.backends.smol.doctor"], capture_output=True, text=True,
                          env=env, timeout=probe.probe_timeout() + probe.DELETE_TIMEOUT + 60)


@pytest.fixture
def isolated_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# The oracle: the SDK booting a machine directly, none of this project's probe code involved (the
# doctor itself boots through probe.boot, so comparing it with probe.boot could never disagree).
INDEPENDENT_BOOT = """
import sys
from smol import ConnectOptions, Machine, MachineConfig, ResourceSpec, SmolError
local = ConnectOptions(target="local")
config = MachineConfig(name=sys.argv[1], resources=ResourceSpec(cpus=1, memory_mb=256, network=False),
                       ready_timeout_seconds=float(sys.argv[2]))
try:
    machine = Machine.create(config, local)
except SmolError as exc:
    print("VERDICT", "down", exc.code)
    print("MESSAGE", exc)
    sys.exit(0)
try:
    print("VERDICT", "up" if machine.exec(["/bin/sh", "-c", "true"]).exit_code == 0 else "down")
finally:
    machine.delete()
"""


def _sdk_boots_a_microvm(limit: float = 30.0) -> tuple[bool, str, str]:
    """(boots, the engine's error code and message when it does not; "" for a timeout)."""
    name = f"pytest-smolvm-oracle-{os.getpid()}"
    try:
        done = subprocess.run([sys.executable, "-c", INDEPENDENT_BOOT, name, str(limit)], capture_output=True,
                              text=True, timeout=limit + 30, start_new_session=True)
    except subprocess.TimeoutExpired:
        return False, "", ""  # a boot that never finishes is no boot
    finally:
        subprocess.run([sys.executable, "-c", "import sys; from smol import ConnectOptions, Machine; "
                        "Machine.delete_by_name(sys.argv[1], ConnectOptions(target='local'))", name],
                       capture_output=True, timeout=60, check=False)
        remove_fork_lock(name)
    verdicts = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("VERDICT ")]
    assert verdicts, f"the oracle gave no verdict: {done.stdout}{done.stderr}"
    message = "".join(line[len("MESSAGE "):] for line in done.stdout.splitlines() if line.startswith("MESSAGE "))
    return verdicts[0][0] == "up", (verdicts[0][1:] or [""])[0], message


def _may_lower_an_oom_score() -> bool:
    """The oracle for CAP_SYS_RESOURCE: a sacrificial child tries what the engine's monitor does."""
    return subprocess.run(["sh", "-c", "echo -500 > /proc/self/oom_score_adj"], capture_output=True,
                          timeout=10).returncode == 0


def test_doctor_agrees_with_a_real_boot(tmp_path: Path, isolated_cache: Path) -> None:
    boots, code, message = _sdk_boots_a_microvm()
    canary = "sk-doctor-canary-do-not-print"
    done = _run_doctor({"SMOL_CLOUD_TOKEN": canary}, tmp_path)
    output = done.stdout + done.stderr
    assert canary not in output, "the doctor printed the cloud token"
    assert "SMOL_CLOUD_TOKEN" in output  # where the key comes from, never the key
    assert "--smol-backend=auto" in output
    if boots:
        assert done.returncode == 0, output
        assert "microVMs boot on this host" in output
    else:  # the namespace backend runs guests instead: the expected outcome here, exit 0
        assert done.returncode == 0, output
        assert "no microVM boots on this host" in output
        assert "what to do" in output or "reason:" in output
        assert "would use namespace" in output
        assert "namespace limits: " in output and "namespace disks: " in output  # what a guest gets here
        if "did not finish within" in output:
            # The doctor gave up before the engine said why (its limit is shorter than the oracle's,
            # and a loaded host stretches both): the engine's last words must still reach the user.
            assert "last VMM message:" in output or not message, output
        elif code:  # the engine's own reason reaches the user
            assert f"[{code}]" in output, output
        if "oom_score_adj" in message:  # a container's root: said in words, with the fix
            assert "may not lower its OOM score (CAP_SYS_RESOURCE is missing)" in output, output
    if sys.platform.startswith("linux") and os.geteuid() == 0:
        confined_root = not _may_lower_an_oom_score()
        assert ("root without CAP_SYS_RESOURCE" in output) == confined_root, output
        assert ("--cap-add=SYS_RESOURCE" in output) == confined_root, output


# The engine's exact words where root lacks CAP_SYS_RESOURCE (here, and a lent GPU machine, 2026-12-04).
OOM_SCORE_REFUSED = ("[SMOLVM_ERROR] Agent error (start machine): agent operation failed: monitor agent: [oom] could "
                     "not set oom_score_adj=-500: Permission denied (os error 13) (boot process exited (code 1) "
                     "before the agent was ready)")


def _doctor_where_the_engine_refused_an_oom_score(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(probe, "boot", lambda limit: probe.BootReport(False, OOM_SCORE_REFUSED, 15.0))
    out = io.StringIO()
    run_doctor(out)
    return out.getvalue()


def test_doctor_explains_an_engine_refused_an_oom_score(monkeypatch: pytest.MonkeyPatch, isolated_cache: Path) -> None:
    text = " ".join(_doctor_where_the_engine_refused_an_oom_score(monkeypatch).split())
    assert "kernel lets a process lower it only with CAP_SYS_RESOURCE" in text, text
    assert "--cap-add=SYS_RESOURCE" in text
    assert "no microVM boots on this host: the microVM monitor may not lower its OOM score" in text
    from pytest_smolvm.backends.smol import boot_failures

    monkeypatch.setattr(boot_failures, "host_causes", lambda: [])  # the engine's words alone
    monkeypatch.setattr(boot_failures, "pvm_evidence", lambda: None)
    assert plain_reason(OOM_SCORE_REFUSED) == "the VMM lacks CAP_SYS_RESOURCE"


@pytest.mark.parametrize(("mode", "group", "caller_in_group", "says", "never"), [
    # this host's state (root:kvm 0660, root not in kvm): the group step is done, joining it is not
    (0o660, "kvm", False, ["it is root:kvm 0660 now", "join kvm", "chmod 0666"], ["give /dev/kvm to a kvm group",
                                                                                 "give it to a kvm group"]),
    (0o660, "kvm", True, ["you are in kvm", "chmod 0666"], ["give it to a kvm group", "usermod"]),
    (0o600, "root", False, ["it is root:root 0600 now", "give it to a kvm group with mode 0660"], []),
])
def test_doctor_fixes_start_from_the_state_dev_kvm_is_in(monkeypatch: pytest.MonkeyPatch, isolated_cache: Path,
                                                        mode: int, group: str, caller_in_group: bool,
                                                        says: list[str], never: list[str]) -> None:
    """A fix never repeats what the host already has (a kvm group, mode 0660)."""
    from pytest_smolvm.backends.smol import doctor
    from pytest_smolvm.backends.smol.boot_failures import KvmFacts

    facts = KvmFacts(True, mode, "root", group, True, "maybe" if caller_in_group else "no")
    monkeypatch.setattr(doctor, "kvm_facts", lambda path="/dev/kvm": facts)
    denied = "[SMOLVM_ERROR] kvm: KvmOpen(Error(13)) Permission denied opening /dev/kvm"
    monkeypatch.setattr(probe, "boot", lambda limit: probe.BootReport(False, denied, 1.0))
    out = io.StringIO()
    run_doctor(out)
    fixes = " ".join(out.getvalue().split("what to do:", 1)[-1].split())
    for needle in says:
        assert needle in fixes, fixes
    for needle in never:
        assert needle not in fixes, fixes


# What the engine said on one PVM host, root without CAP_SYS_RESOURCE, /dev/kvm root:kvm 0660, in
# three runs (issue 44): whichever step the boot reached first.
ENGINE_SAID = ["boot did not finish within 20s (last VMM message: waiting for the agent)",
               "[SMOLVM_ERROR] could not open /dev/kvm: KvmOpen(Error(13)): Permission denied. Add your user to the "
               "'kvm' group: sudo usermod -aG kvm $USER Then log out and log back in",
               OOM_SCORE_REFUSED]


def test_the_fallback_reason_is_the_same_whatever_the_engine_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's summary line is read from the host's facts, which do not change between runs."""
    from pytest_smolvm.backends.base import ProbeResult
    from pytest_smolvm.backends.selection import select_backend
    from pytest_smolvm.backends.smol import boot_failures

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(boot_failures, "has_capability", lambda number, status=None: False)
    from pytest_smolvm.backends.smol.boot_failures import KvmFacts

    facts = KvmFacts(True, 0o660, "root", "kvm", True, "no")
    monkeypatch.setattr(boot_failures, "kvm_facts", lambda path="/dev/kvm": facts, raising=False)
    monkeypatch.setattr(boot_failures, "pvm_evidence", lambda: "the kvm_pvm kernel module is loaded")
    monkeypatch.delenv("SMOLVM_VM_UID_DROP", raising=False)

    def refused(said: str) -> Callable[[], ProbeResult]:
        return lambda: ProbeResult(False, said)

    reasons = {select_backend("auto", "local", probe=refused(said)).reason
               for said in ENGINE_SAID}
    assert len(reasons) == 1, reasons
    assert reasons.pop().startswith("no microVM boots here: this is a PVM host, where no stock guest kernel boots; ")
    # Off a PVM host, the host's facts: still one answer whatever the engine said.
    monkeypatch.setattr(boot_failures, "pvm_evidence", lambda: None)
    reasons = {select_backend("auto", "local", probe=refused(said)).reason
               for said in ENGINE_SAID}
    assert len(reasons) == 1, reasons
    assert reasons.pop().startswith("no microVM boots here: the VMM lacks CAP_SYS_RESOURCE and may not open /dev/kvm; ")


def test_where_the_host_explains_nothing_the_engines_reason_is_kept_whole(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    from pytest_smolvm.backends.smol import boot_failures

    monkeypatch.setattr(boot_failures, "host_causes", lambda: [], raising=False)
    monkeypatch.setattr(boot_failures, "pvm_evidence", lambda: None)
    assert plain_reason(ENGINE_SAID[0]) == "boot did not finish within 20s"
    assert plain_reason(ENGINE_SAID[1]) == "the VMM may not open /dev/kvm"
    # The VMM's last message, quoted in a timed-out probe's reason, is cut at a sentence's end.
    monkeypatch.setattr(probe, "vm_data_dir", lambda name: tmp_path)
    sentence = "The guest kernel did not answer the agent in time. " * 20
    (tmp_path / "agent-startup-error.log").write_text(f"earlier line\n{sentence}then log out and log back in\n")
    quoted = probe._last_boot_message("probe-x")
    assert quoted.startswith("The guest kernel") and ". [" in quoted and quoted.endswith(" more characters]")
    assert len(quoted) < 450


def test_doctor_output_reads_as_blocks(monkeypatch: pytest.MonkeyPatch, isolated_cache: Path) -> None:
    # Each check, the verdict and each fix is a block: its first line says what it is, the rest
    # hang indented under it, and no word is cut at a hyphen ("copy-" / "on-write").
    output = _doctor_where_the_engine_refused_an_oom_score(monkeypatch)
    lines = output.splitlines()
    starts = re.compile(r"^(pytest-smolvm doctor$|\[ *\w+\] |verdict: |what to do:$|  \d+\. |$)")
    assert [line for line in lines if not starts.match(line) and not line.startswith(" ")] == [], output
    assert [line for line in lines if line.endswith("-")] == [], output
    assert any(line.startswith("verdict: ") for line in lines) and "reason: [SMOLVM_ERROR]" in output


def test_doctor_says_which_smolmachines_pytest_smolvm_was_checked_against(
        monkeypatch: pytest.MonkeyPatch, isolated_cache: Path) -> None:
    """A new SDK release (1.37.3 came out under 1.32.2's reading and changed the cloud exec):
    the doctor says the installed version was not the one read, whether the internals the
    smol backend uses are still there, and how to get the version read."""
    from smol import transport

    from pytest_smolvm.backends.smol import sdk

    installed = sdk.installed_version()
    assert "smolmachines: " + f"{installed}, the version pytest-smolvm was checked against" in \
        _doctor_where_the_engine_refused_an_oom_score(monkeypatch)
    monkeypatch.setattr(sdk, "SDK_VERSION_READ", "1.0.0")
    output = " ".join(_doctor_where_the_engine_refused_an_oom_score(monkeypatch).split())
    assert f"[warn] smolmachines: {installed}; pytest-smolvm was checked against 1.0.0: the SDK internals" \
           in output and "pip install 'smolmachines==1.0.0'" in output, output
    monkeypatch.delattr(transport, "_wait_for_ready")
    output = " ".join(_doctor_where_the_engine_refused_an_oom_score(monkeypatch).split())
    assert f"[FAIL] smolmachines: {installed}; pytest-smolvm was checked against 1.0.0, and SDK internals" \
           in output and "_wait_for_ready" in output, output


def test_doctor_explains_a_pvm_host(tmp_path: Path) -> None:
    evidence = pvm_evidence()
    if evidence is None:
        pytest.skip("not a PVM host")
    done = _run_doctor({}, tmp_path)
    assert done.returncode == 0, done.stdout  # the namespace backend runs guests here
    assert "PVM host" in done.stdout and "built for PVM" in done.stdout
    assert "real KVM" in done.stdout


def test_probe_is_cached_per_boot(isolated_cache: Path) -> None:
    first = probe.probe()
    assert (isolated_cache / probe.CACHE_FILE).is_file()
    started = time.monotonic()
    again = probe.probe()
    assert again == first
    assert time.monotonic() - started < 1.0, "a cached probe booted again"


def test_probe_boot_never_outlives_its_timeout(isolated_cache: Path) -> None:
    limit = 4.0
    started = time.monotonic()
    report = probe.boot(limit)
    elapsed = time.monotonic() - started
    # Killing the child is immediate; deleting a half-made machine may take its own bounded time.
    assert elapsed < limit + probe.DELETE_TIMEOUT + 5, f"{elapsed:.1f}s for a {limit}s probe"
    assert report.reason


def test_a_stalled_boot_is_killed_and_cleaned_up(monkeypatch: pytest.MonkeyPatch,
                                                 isolated_cache: Path) -> None:
    """On a PVM host a guest with the uid drop off hangs at boot: the stall the timeout exists for."""
    if pvm_evidence() is None or probe.precheck() is not None:
        pytest.skip("only a PVM host with KVM reliably stalls a boot")
    from pytest_smolvm.backends.smol.backend import list_owned

    # This probe's own machines, by name: other workers' probes may boot on this host meanwhile.
    fixed = uuid.uuid4()
    monkeypatch.setattr(probe, "uuid", types.SimpleNamespace(uuid4=lambda: fixed))
    name = f"{probe.PROBE_NAME_PREFIX}{fixed.hex[:12]}"
    ours = {name, f"{name}-b"}
    data_dirs = {vm_data_dir(each) for each in ours}
    monkeypatch.setenv("SMOLVM_VM_UID_DROP", "off")
    limit = 5.0
    started = time.monotonic()
    report = probe.boot(limit)
    elapsed = time.monotonic() - started
    assert not report.available
    if not report.timed_out:
        pytest.skip(f"the boot did not stall here: {report.reason}")
    assert report.reason.startswith(f"boot did not finish within {limit:g}s")
    assert elapsed < limit + probe.DELETE_TIMEOUT + 5
    assert [m.name for m in list_owned({"pytest-smolvm": "1", "role": "probe"}) if m.name in ours] == []
    assert [str(d) for d in data_dirs if d.exists()] == [], "the probe left its data dir"
    deadline = time.monotonic() + 10
    while _vmm_pids(data_dirs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _vmm_pids(data_dirs), "a VMM process outlived the probe"


def _vmm_pids(data_dirs: set[Path]) -> set[int]:
    """Live (not zombie) smolmachines VMM processes of these machines (their data dir is in the
    VMM's command line: ``smol-vmm _boot-vm <data dir>/boot-config.json``)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"smol-vmm" in cmdline and state != b"Z" and any(str(d).encode() in cmdline for d in data_dirs):
            found.add(int(entry))
    return found
