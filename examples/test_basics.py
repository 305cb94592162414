"""exec, files, the smol marker and exec timeouts: one fresh guest per test."""

import pytest

from pytest_smolvm import VM, ExecError


def test_exec_string_and_argv(smol_vm: VM) -> None:
    r = smol_vm.exec("echo hello from $(uname -s)")  # a string runs under /bin/sh -c
    assert r.exit_code == 0
    assert r.stdout == "hello from Linux\n"

    r = smol_vm.exec(["printf", "%s|", "a b", "$HOME"])  # a list is argv: no shell, no expansion
    assert r.stdout == "a b|$HOME|"


def test_exit_codes_and_check(smol_vm: VM) -> None:
    r = smol_vm.exec("echo oops >&2; exit 3")
    assert (r.exit_code, r.stderr, r.ok) == (3, "oops\n", False)
    with pytest.raises(ExecError, match="exited 3"):
        r.check()
    with pytest.raises(ExecError):
        smol_vm.exec("false", check=True)


def test_write_and_read_files(smol_vm: VM) -> None:
    smol_vm.write_file("/workspace/answer.txt", "42\n")  # parent dirs are created
    assert smol_vm.read_file("/workspace/answer.txt") == b"42\n"
    assert smol_vm.exec("cat answer.txt", workdir="/workspace").stdout == "42\n"


def test_state_persists_between_execs(smol_vm: VM) -> None:
    smol_vm.exec("echo 1 > /tmp/counter")
    smol_vm.exec("echo $(( $(cat /tmp/counter) + 1 )) > /tmp/counter")
    assert smol_vm.read_file("/tmp/counter") == b"2\n"


@pytest.mark.smol(env={"MODE": "eval"}, timeout=5)
def test_marker_env_and_hook_env(smol_vm: VM) -> None:
    r = smol_vm.exec('echo "$MODE $SUITE $EXTRA"', env={"EXTRA": "per-exec"})
    assert r.stdout == "eval examples per-exec\n"  # SUITE comes from conftest.py's hook


def test_exec_timeout_kills_the_guest_command(smol_vm: VM) -> None:
    r = smol_vm.exec("echo started; sleep 30", timeout=0.5)
    assert r.timed_out and not r.ok
    assert r.stdout == "started\n"
    assert r.duration < 5
    assert smol_vm.exec(["pgrep", "-f", "sleep 30"]).exit_code == 1  # killed in the guest


@pytest.mark.smol(timeout=0.5)
def test_marker_timeout_is_the_default_exec_timeout(smol_vm: VM) -> None:
    assert smol_vm.exec("sleep 30").timed_out
    assert smol_vm.exec("sleep 1", timeout=5).ok  # a per-call timeout overrides it
