"""``pytest-smolvm shell`` driven from a real terminal: the guest never holds the user's terminal.

The CLI runs in a subprocess whose stdin/stdout/stderr and controlling terminal are the slave of
a pty this test made (the user's terminal); the test is the user, typing into the master. A
guest daemon the shell leaves behind tries to write to that terminal and to read what the user
types after the shell has returned. Harmless if the attack succeeds: the terminal is the test's.
"""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_smolvm.backends.namespace.guest import NamespaceGuest
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.host import registry

# The guest command: says whether it has a terminal, echoes one typed line, then leaves a daemon
# (a session of its own, as a hostile guest would make it) that writes to its fds and reads one,
# and a background job in the command's own group.
SCRIPT = ("test -t 0 && echo IN-A-TTY; read line; echo \"got:$line\"; sleep 301 & "
          "setsid sh -c 'trap \"\" HUP; sleep 1; echo LEAKED-AFTER-RETURN; echo LEAKED >&2; "
          "read typed; echo \"$typed\" > /tmp/typed' </dev/stdin >/dev/stdout 2>/dev/stderr & "
          "sleep 0.5; echo started")  # the daemon has left the group before the command ends


@pytest.fixture
def kept(vm: VM) -> Iterator[VM]:
    guest = vm._guest
    assert isinstance(guest, NamespaceGuest)
    guest.keep()
    record = registry.Record.for_this_process(vm.name, "namespace", "sec", "sec", "test_shell_door")
    record.data, record.kept = guest.registry_data(), True
    record.save()
    try:
        yield vm
    finally:
        record.remove()


def _read_until(master: int, needle: bytes, seen: bytearray, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while needle not in seen and time.monotonic() < deadline:
        if select.select([master], [], [], 0.1)[0]:
            try:
                seen += os.read(master, 4096)
            except OSError:
                break
    return needle in seen


def _ctty() -> None:  # the CLI's terminal is its controlling terminal, as in a user's shell
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_the_shell_gets_a_relayed_pty_and_leaves_nothing_on_the_users_terminal(kept: VM) -> None:
    master, slave = os.openpty()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        shell = subprocess.Popen([sys.executable, "-m", "pytest_smolvm.cli", "shell", kept.name, "sh", "-c", SCRIPT],
                                 stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
                                 preexec_fn=_ctty)
        seen = bytearray()
        try:
            assert _read_until(master, b"IN-A-TTY", seen, 30), bytes(seen)  # the command has a terminal
            os.write(master, b"hello\r")  # typed while the shell runs: relayed to the command
            assert _read_until(master, b"got:hello", seen, 10), bytes(seen)
            assert shell.wait(timeout=30) == 0, bytes(seen)
        finally:
            if shell.poll() is None:
                shell.kill()
                shell.wait()
        local = termios.tcgetattr(slave)[3]  # the user's terminal is back in its own mode (raw while relaying)
        assert local & termios.ICANON and local & termios.ECHO
        # The shell has returned; the user's terminal (still open, as the user's own shell holds
        # it) must hear nothing more from the guest, and what the user types stays on the host.
        os.write(master, b"typed-after-return\r")
        after = bytearray()
        _read_until(master, b"LEAKED", after, 3)
        assert b"LEAKED" not in after, bytes(after)
        # The daemon ran its read (it ignores the hangup) and got nothing: a hung-up pty, the host's.
        assert kept.exec("cat /tmp/typed").stdout == "\n"
        # Nothing of the command's own group is left in the guest.
        left = kept.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert "sleep 301" not in left, left
    finally:
        os.close(master)
        os.close(slave)


def test_a_scripts_shell_gets_relayed_pipes_and_returns_without_its_daemons(kept: VM) -> None:
    """Without a terminal (a script's stdin): pipes the host made, stdout and stderr apart, a
    MiB each way through the relay; a daemon left behind can neither hold the caller's pipes
    open (the caller would wait for it) nor write into them later."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    payload = os.urandom(1 << 19).hex() + "\n"
    script = "cat; echo to-err >&2; setsid sh -c 'sleep 5; echo late; echo late >&2' & sleep 0.3"
    begun = time.monotonic()
    shell = subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", "shell", kept.name, "sh", "-c", script],
                           input=payload, capture_output=True, text=True, env=env, timeout=30)
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout == payload
    assert shell.stderr == "to-err\n"
    assert time.monotonic() - begun < 4  # returned with the command, not with its daemon


def test_a_terminal_shell_with_its_output_redirected_gets_the_bytes_as_written(kept: VM) -> None:
    """Typed at a terminal, written to a file: pipes, not a pty (whose CRLFs would end up in it)."""
    master, slave = os.openpty()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", "shell", kept.name, "sh", "-c",
                               "printf 'a\\nb\\n'; test -t 0 || echo no-tty"], stdin=slave, capture_output=True,
                              env=env, timeout=30, start_new_session=True, preexec_fn=_ctty)
    finally:
        os.close(master)
        os.close(slave)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"a\nb\nno-tty\n"
