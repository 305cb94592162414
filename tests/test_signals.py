"""Ctrl-C and friends where guests do not die with their socket: smol machines on the loopback
cloud. A namespace guest's init exits when its pytest goes, so a signal test on it passes
whether or not the plugin destroys anything; a cloud machine stays until it is deleted.

And a create cut off by a test timeout while the backend answers: the guest it made ends
recorded and destroyed, never known to nobody.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_smolvm.host import registry
from tests.smolcloud.harness import LoopbackCloud
from tests.waits import pytest_under_way

SMOL = ["--smol-backend=smol", "--smol-target=cloud", "--smol-baseline=alpine", "-p", "no:cacheprovider"]

# In the pytest under test: the first delete waits until the main thread is inside
# GuestPool.close, sends SIGINT to the whole process from this (teardown) thread, and only
# then deletes, slowly. The kernel gives the signal to a thread that does not block it.
SIGNAL_DURING_CLOSE = """
import os, signal, sys, threading, time
from pytest_smolvm.backends.smol.guest import SmolGuest

_destroy = SmolGuest.destroy
_sent = []

def _in_close():
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "close" and frame.f_code.co_filename.endswith("pool.py"):
            return True
        frame = frame.f_back
    return False

def destroy(self):
    if not _sent:
        _sent.append(1)
        deadline = time.monotonic() + 30
        while not _in_close() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
    if threading.current_thread() is not threading.main_thread():
        time.sleep(1.5)  # slower than the rest of the exit: only a close() that waits sees it done
    _destroy(self)

SmolGuest.destroy = destroy
"""


# In the pytest under test: each delete the pool hands off takes a moment, as on a real cloud
# under load (the backend's own close, at exit, deletes at once whatever it still has).
SLOW_DELETES = """
import threading, time
from pytest_smolvm.backends.smol.guest import SmolGuest

_destroy = SmolGuest.destroy

def destroy(self):
    if threading.current_thread().name != "MainThread":
        time.sleep(0.5)
    _destroy(self)

SmolGuest.destroy = destroy
"""


def _children(cloud: LoopbackCloud, token: str) -> list[dict[str, object]]:
    return [m for m in cloud.machines() if m["owner"] == token]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_test_deletes_every_machine(pytester: pytest.Pytester, cloud: LoopbackCloud, token: str,
                                                 smol_state: Path, sig: signal.Signals) -> None:
    """Fails without GuestPool.close(): the destroys handed to the teardown thread are cut off
    at exit, their records left behind (the backend's own close deletes the machines)."""
    started = pytester.path / "started"
    pytester.makeconftest(SLOW_DELETES)
    pytester.makepyfile(f"""
        import time
        from pathlib import Path

        def test_long(smol_vm_factory):
            for _ in range(4):
                smol_vm_factory()
            Path({str(started)!r}).write_text("")
            time.sleep(120)
    """)
    proc = pytest_under_way(SMOL, pytester.path, started)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "INTERNALERROR" not in out, out
    # Nothing left for the reaper: every machine deleted and every record gone, by this run itself.
    assert _children(cloud, token) == [], out
    assert list(registry.records()) == [], out


def test_a_signal_taken_by_another_thread_mid_close_waits_for_the_deletes(
        pytester: pytest.Pytester, cloud: LoopbackCloud, token: str, smol_state: Path) -> None:
    """Fails with the deferral reduced to masking the main thread: the kernel hands the SIGINT to
    the teardown thread, CPython raises it in close() and the deletes are cut off."""
    pytester.makeconftest(SIGNAL_DURING_CLOSE)
    pytester.makepyfile("""
        def test_three_guests(smol_vm_factory):
            for _ in range(3):
                smol_vm_factory()
    """)
    result = pytester.runpytest_subprocess(*SMOL, timeout=300)
    out = result.stdout.str() + result.stderr.str()
    assert result.ret != 0 and "KeyboardInterrupt" in out, out  # delivered, once close was done
    assert _children(cloud, token) == [], out
    assert list(registry.records()) == [], out


# In the pytest under test: the second create waits, once the helper has answered, until the
# test's timeout (SIGALRM) has fired: the interrupt lands while the reply is in hand.
SLOW_SECOND_ANSWER = """
import time
from pytest_smolvm.backends.namespace.zygote import Zygote

_request = Zygote.request
_creates = []

def request(self, message):
    reply = _request(self, message)
    if message.get("op") == "create":
        _creates.append(1)
        if len(_creates) == 2:
            time.sleep(4)
    return reply

Zygote.request = request
"""


def test_a_create_cut_off_by_a_test_timeout_ends_recorded_and_destroyed(
        pytester: pytest.Pytester, smol_state: Path) -> None:
    """Fails when the interrupted create forgets its guest: the reply (and the guest's control
    socket) stayed with nobody, the init alive and unrecorded until pytest exits."""
    pytester.makeconftest(SLOW_SECOND_ANSWER)
    pytester.makepyfile(f"""
        import os, time
        from pathlib import Path
        import pytest
        from pytest_smolvm.backends.namespace.cgroups import state_tag

        TAG = state_tag(Path({str(smol_state)!r})).encode()

        def helper_processes():
            found = []
            for entry in os.listdir("/proc"):
                try:
                    argv = Path("/proc", entry, "cmdline").read_bytes().split(b"\\0")
                except OSError:
                    continue
                if TAG in argv:
                    found.append(entry)
            return found

        def test_first_guest(smol_vm):
            assert len(helper_processes()) == 2  # the helper and this guest's init

        @pytest.mark.timeout(2, method="signal")
        def test_times_out_while_its_guest_is_made(smol_vm):
            pass

        def test_next_finds_that_guest_destroyed():
            deadline = time.monotonic() + 20
            while len(helper_processes()) > 1:  # the helper stays for the session
                assert time.monotonic() < deadline, helper_processes()
                time.sleep(0.05)
    """)
    result = pytester.runpytest_subprocess("--smol-max-vms=50", "-p", "no:randomly", timeout=300)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*Timeout*"])


GUEST_FROM_A_BLOCKING_THREAD = """
import signal, sys
from pytest_smolvm import Session
from pytest_smolvm.host.signals import start_thread

out = {}
def make_and_run():
    # The first guest starts the namespace helper from this thread, which blocks SIGTERM as
    # every thread the plugin starts does; the guest must not inherit that mask.
    with Session(backend="namespace") as session:
        vm = session.create("blocked-thread")
        out["term"] = vm.exec(["sh", "-c", "kill -TERM $$"], timeout=30).exit_code
        out["mask"] = vm.exec("grep SigBlk /proc/self/status").stdout.split()[-1]
start_thread(make_and_run, name="blocking").join()
print(out["term"], out["mask"])
"""


def test_guests_made_from_a_thread_that_blocks_signals_start_with_none_blocked(smol_state: Path) -> None:
    """Threads the plugin starts block SIGINT/SIGTERM/SIGHUP; a signal mask survives fork and exec,
    so the namespace helper started from one gave every guest process that mask, and a guest
    command's own `kill -TERM $$` did nothing (Inspect's fast-signal-death check saw exit 0)."""
    done = subprocess.run([sys.executable, "-c", GUEST_FROM_A_BLOCKING_THREAD], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["143", "0000000000000000"], done.stdout + done.stderr


RESTORE_CUT_SHORT = """
import signal
from pytest_smolvm.host import signals

SIGS = signals.DEFERRED_SIGNALS
before = {s: signal.getsignal(s) for s in SIGS}
real = signal.signal

def landing(sig, handler):
    # A Ctrl-C arriving the moment SIGINT's own handler is back: it raises right there.
    previous = real(sig, handler)
    if sig == signal.SIGINT and handler is not signals._hold:
        signal.signal = real
        raise KeyboardInterrupt
    return previous

signal.signal = landing
try:
    with signals.signals_deferred():
        pass
except KeyboardInterrupt:
    print("interrupted")
print("restored", {s: signal.getsignal(s) for s in SIGS} == before)
with signals.signals_deferred():
    print("deferring", all(signal.getsignal(s) is signals._hold for s in SIGS))
print("restored", {s: signal.getsignal(s) for s in SIGS} == before)
"""


def test_a_signal_landing_as_the_handlers_come_back_leaves_deferral_working(tmp_path: Path) -> None:
    """Issue 43: the depth counter was reset after the handlers were restored; an interrupt in
    between left it at 1 (every later deferral deferred nothing) and the later handlers holding."""
    done = subprocess.run([sys.executable, "-c", RESTORE_CUT_SHORT], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["interrupted", "restored True", "deferring True", "restored True"]
