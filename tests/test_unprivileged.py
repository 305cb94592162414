"""The plugin as a normal user: guests in a user namespace, same guarantees."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.leaks import assert_host_clean

NOBODY = 65534


def _userns_allowed() -> bool:
    try:
        return int(Path("/proc/sys/user/max_user_namespaces").read_text()) > 0 and Path(
            "/proc/sys/kernel/unprivileged_userns_clone").read_text().strip() != "0"
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False


def _nobody_cannot_import() -> str:
    """Why user nobody cannot run this Python with the plugin (a venv under /root, say), or ""."""
    probe = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c",
         "import pytest, xdist, pytest_smolvm.plugin.hooks"],
        env=_base_env(), cwd="/", capture_output=True, text=True, timeout=60)
    if probe.returncode == 0:
        return ""
    lines = (probe.stderr or probe.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {probe.returncode}"


def _base_env() -> dict[str, str]:
    env = {"PATH": os.environ["PATH"]}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another user for the test"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv"),
    pytest.mark.skipif(not _userns_allowed(), reason="unprivileged user namespaces are disabled on this host"),
]


@contextlib.contextmanager
def nobody_home() -> Iterator[Path]:
    """A home dir of user nobody's (state, cache and tmp inside), removed afterwards; write the
    test files into it, then :func:`run_as_nobody`."""
    why = _nobody_cannot_import()
    if why:
        pytest.skip(f"user nobody cannot import this interpreter's pytest and plugin: {why}")
    home = Path(tempfile.mkdtemp(prefix="smolvm-nobody-"))
    try:
        home.chmod(0o755)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run_as_nobody(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest with the namespace backend as user nobody in ``home``; the run must leave nothing."""
    for sub in ("state", "cache", "tmp"):
        (home / sub).mkdir(exist_ok=True)
    os.chown(home, NOBODY, NOBODY)
    for path in home.rglob("*"):
        os.chown(path, NOBODY, NOBODY)
    env = {**_base_env(), "HOME": str(home), "PYTEST_SMOLVM_STATE_DIR": str(home / "state"),
           "PYTEST_SMOLVM_CACHE_DIR": str(home / "cache"), "TMPDIR": str(home / "tmp"),
           "XDG_CACHE_HOME": str(home / "cache"), "XDG_DATA_HOME": str(home / "cache")}
    result = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-m", "pytest",
         "-p", "no:cacheprovider", "--smol-backend=namespace", *args],
        cwd=home, env=env, capture_output=True, text=True, timeout=300)
    assert "guests run in a user namespace (unprivileged)" in result.stdout, result.stdout + result.stderr
    assert_host_clean(home / "state")
    return result


@pytest.mark.usefixtures("shared_cache")
def test_a_normal_user_gets_isolated_guests() -> None:
    with nobody_home() as home:
        (home / "test_user.py").write_text('''
import pytest

from pytest_smolvm import GuestUserError

@pytest.mark.parametrize("i", range(4))
def test_guest(smol_vm, i, tmp_path):
    assert smol_vm.exec("id -u").stdout == "0\\n"          # root inside its own user namespace
    assert smol_vm.exec("id -u", user="root").stdout == "0\\n"
    # ranked above the init for the OOM killer: here its score is written just after the spawn
    assert smol_vm.exec("sleep 0.2; cat /proc/self/oom_score_adj").stdout == "1000\\n"
    with pytest.raises(GuestUserError, match="maps only root"):  # no other uid is mapped
        smol_vm.exec("true", user="nobody")
    assert smol_vm.exec("ls /workspace").stdout == ""     # nothing from another test
    smol_vm.write_file("/workspace/mine", str(i))
    smol_vm.copy_in(__file__, "/workspace/copied.py")
    assert smol_vm.exec("test -x /bin/sh && test -e /workspace/copied.py").exit_code == 0
    tree = tmp_path / "tree"
    for d in range(4):
        (tree / f"d{d}").mkdir(parents=True)
        for f in range(100):
            (tree / f"d{d}" / f"f{f}").write_text(f"{d}/{f}")
    smol_vm.copy_in(tree, "/workspace/tree")  # past the unpacker's first 256 files: writers make the rest
    assert smol_vm.exec("find /workspace/tree -type f | wc -l").stdout == "400\\n"
    assert smol_vm.exec("cat /workspace/tree/d3/f99").stdout == "3/99"
    smol_vm.copy_out("/workspace", tmp_path / "out")
    assert (tmp_path / "out" / "mine").read_text() == str(i)

def test_branch(smol_vm):
    # vm.branch in a user namespace: the copy keeps the overlay's whiteouts and opaque dirs
    smol_vm.exec("rm /etc/hostname && rm -rf /etc/apk && mkdir /etc/apk && echo x > /etc/apk/mine", check=True)
    child = smol_vm.branch()
    assert child.exec("test -e /etc/hostname").exit_code == 1
    assert child.exec("ls /etc/apk").stdout == "mine\\n"
    child.write_file("/etc/apk/mine", "child")
    assert smol_vm.read_file("/etc/apk/mine") == b"x\\n"
''')
        result = run_as_nobody(home, "-n", "2", str(home / "test_user.py"))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "5 passed" in result.stdout


@pytest.mark.usefixtures("shared_cache")
def test_a_limit_the_host_cannot_enforce_is_refused_not_ignored() -> None:
    """A normal user's process seldom has a cgroup to give: a guest whose test named
    ``memory_mb`` or ``cpus`` then ran with no such bound at all (rlimits cover processes and
    file size, not memory or CPU time). Now it does not start: one line naming the limit and
    why; a guest that named none runs as before (the run's header says limits are not applied)."""
    with nobody_home() as home:
        (home / "test_limits.py").write_text('''
import pytest

@pytest.mark.smol(memory_mb=64)
def test_memory(smol_vm):
    smol_vm.exec("true", check=True)

@pytest.mark.smol(cpus=1.5)
def test_cpus(smol_vm):
    smol_vm.exec("true", check=True)

def test_default(smol_vm):
    smol_vm.exec("true", check=True)
''')
        result = run_as_nobody(home, "-p", "no:randomly", "-rE", str(home / "test_limits.py"))
        out = result.stdout + result.stderr
        assert "INTERNALERROR" not in out, out
        header = next(line for line in out.splitlines() if line.startswith("smolvm: limits: "))
        # "cgroup v2: cpu, memory, pids" or "not applied (...)", then what a test may not name here
        applied = header.removeprefix("smolvm: limits: ").partition(";")[0]
        delegated = applied.split(": ", 1)[1].split(", ") if applied.startswith("cgroup ") else []
        refused = {"memory": "memory_mb=64", "cpu": "cpus=1.5"}
        for controller, asked in refused.items():
            message = f"{asked} cannot be enforced for this guest: no {controller} cgroup here"
            assert (message in out) == (controller not in delegated), (controller, header, out)
            assert (asked.partition("=")[0] in header.partition(";")[2]) == (controller not in delegated), header
        errors = sum(controller not in delegated for controller in refused)
        assert f"{3 - errors} passed" in out and (f"{errors} error" in out) == bool(errors), out
