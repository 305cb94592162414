"""A guest that stops every process it can see (``kill -STOP -1`` in a loop) cannot wedge its
init or the host: a call with a timeout returns within it plus a short grace, a guest whose init
stops answering is given up (killed from the host) with one ``GuestError``, and a guest whose
owner dies goes with it, wedged or not, without holding up the cleanup of the others.

Harmless if the attack succeeds: the loop signals only its own pid namespace (``kill -1`` never
leaves it), and every guest is destroyed by ``make_vm`` or by the test itself.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pytest_smolvm import limits
from pytest_smolvm.errors import GuestError
from pytest_smolvm.handle.vm import VM
from tests.leaks import assert_host_clean

# Stops everything in the guest but pid 1 and itself, as fast as it can: it catches the init's
# request children between their fork (or vfork) and their setsid or execve.
STOP_LOOP = "nohup sh -c 'while :; do kill -STOP -1; done' >/dev/null 2>&1 &"
# A call's own timeout (1 s), the init's 2 s for a killed group, the host's grace for an answer
# (LIMITS.guest_answer_grace, 5 s), and slack for a loaded 2-core host: never more than this.
BOUND = 1 + 2 + 5 + 4

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def short_limits() -> Iterator[None]:
    saved = limits.LIMITS
    limits.LIMITS = dataclasses.replace(saved, guest_file_op=2.0)
    try:
        yield
    finally:
        limits.LIMITS = saved


def stopping_guest(make_vm: Callable[..., VM]) -> VM:
    vm = make_vm()
    vm.exec(STOP_LOOP, timeout=10)
    time.sleep(0.3)
    return vm


def assert_guest_gone(data: dict[str, object]) -> None:
    """Nothing of one destroyed guest is left: its init (and with it its pid namespace: the
    loop), its cgroups, its scratch dir."""
    pid = int(data["pid"])  # type: ignore[call-overload]
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        assert stat.rsplit(")", 1)[1].split()[0] == "Z", f"guest init {pid} still runs"
    except FileNotFoundError:
        pass
    for path in [*data["cgroups"], data["scratch"]]:  # type: ignore[misc]
        assert not os.path.exists(str(path)), f"left behind: {path}"


def outcome(call: Callable[[], object]) -> tuple[str, float]:
    """What a call did (returned, timed out, raised what) and how long it took."""
    start = time.monotonic()
    try:
        result = call()
        what = "timed out" if getattr(result, "timed_out", False) else "returned"
    except GuestError as exc:
        what = f"GuestError: {exc}"
    except OSError as exc:
        what = f"OSError: {exc}"
    return what, time.monotonic() - start


@pytest.mark.parametrize("user", [None, "root"], ids=["spawned", "forked"])
def test_exec_with_a_timeout_returns_under_a_stop_loop(make_vm: Callable[..., VM], user: str | None) -> None:
    """``spawned``: the command starts by posix_spawn (vfork), which holds the init until the
    child execs: a child stopped before that held the init for ever. ``forked``: the child
    (an exec as a named user) was stopped before its setsid, and the init's kill of its
    process group found no group."""
    vm = stopping_guest(make_vm)
    data = vm._guest.registry_data()
    for _ in range(4):
        what, took = outcome(lambda: vm.exec(["true"], timeout=1, user=user))
        assert took < BOUND, f"exec took {took:.1f}s ({what})"
        assert what in ("returned", "timed out") or "stopped answering" in what, what
    vm._guest.destroy()
    assert_guest_gone(data)


def test_exec_without_a_timeout_is_never_held_by_a_stopped_spawn(make_vm: Callable[..., VM]) -> None:
    """With no timeout, nothing used to free an init held in a command's spawn: the call waited
    for ever. A call that has no pid for its command after a second looks for a held init and
    frees it, so each exec ends: the command ran, or its stopped spawn was killed (137)."""
    vm = stopping_guest(make_vm)
    data = vm._guest.registry_data()
    results: list[tuple[str, float]] = []

    def execs() -> None:
        for _ in range(6):
            results.append(outcome(lambda: vm.exec(["true"], timeout=None)))

    runner = threading.Thread(target=execs, daemon=True)
    runner.start()
    runner.join(45)  # within the module's 60 s: each exec takes a second or two at most
    alive = runner.is_alive()
    vm._guest.destroy()  # ends a call still waiting
    assert not alive, f"an exec with no timeout was still waiting after {len(results)} returned: {results}"
    assert all(what == "returned" and took < BOUND for what, took in results), results
    assert_guest_gone(data)


def test_file_ops_end_within_their_timeout_under_a_stop_loop(make_vm: Callable[..., VM], short_limits: None,
                                                            tmp_path: Path) -> None:
    vm = stopping_guest(make_vm)
    data = vm._guest.registry_data()
    calls: list[Callable[[], object]] = [
        lambda: vm.read_file("/workspace/nothing-here"),
        lambda: vm.write_file("/workspace/x", "1"),
        lambda: vm.copy_out("/etc", tmp_path / "etc", timeout=2),
    ] * 2
    for call in calls:
        what, took = outcome(call)
        assert took < BOUND, f"file op took {took:.1f}s ({what})"
    vm._guest.destroy()
    assert_guest_gone(data)


def test_a_guest_that_stops_answering_is_given_up_not_waited_for(make_vm: Callable[..., VM]) -> None:
    """Whatever holds the init (here the host stops it: the guest cannot), a call whose timeout
    fired waits a short grace for the guest's answer, then kills the guest and says so."""
    vm = make_vm()
    data = vm._guest.registry_data()
    os.kill(int(data["pid"]), signal.SIGSTOP)
    what, took = outcome(lambda: vm.exec(["sleep", "30"], timeout=1))
    assert took < BOUND, f"exec took {took:.1f}s ({what})"
    assert what.startswith("GuestError") and "stopped answering" in what, what
    assert "\n" not in what
    what, took = outcome(lambda: vm.exec(["true"], timeout=1))  # the guest is gone: at once
    assert what.startswith("GuestError") and took < 2, (what, took)
    vm._guest.destroy()
    assert_guest_gone(data)


OWNER = """
import os, signal, sys, threading, time, uuid
from pathlib import Path
from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.baselines.baseline import resolve

backend = NamespaceBackend()
baseline = resolve(None, Path(sys.argv[1]))
guests = [backend.create(VMSpec(name=f"own-{uuid.uuid4().hex[:8]}", baseline=baseline)) for _ in range(3)]
# One wedged by the guest itself (its init held in vfork by a stopped child), one stopped from
# outside (an init that answers nothing at all), one healthy.
guests[0].exec(["sh", "-c", sys.argv[2]], env={}, workdir=None, stdin=None, timeout=10, output_limit=1 << 16)
time.sleep(0.3)
threading.Thread(target=lambda: guests[0].exec(["true"], env={}, workdir=None, stdin=None, timeout=None,
                                               output_limit=1 << 16), daemon=True).start()
os.kill(guests[1].pid, signal.SIGSTOP)
time.sleep(1)
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the owner dies without destroying anything
"""


def test_guests_die_with_their_owner_even_wedged_and_none_holds_up_the_others(
        tmp_path: Path, baseline: object) -> None:
    """The zygote's janitor waited for each init to exit by itself, all of them within one
    shared 5 s: a wedged init never did, kept its guest alive after its owner, and used up the
    time of the guests after it (their cgroups, scratch dirs and records stayed)."""
    state = tmp_path / "state"
    env = {**os.environ, "PYTEST_SMOLVM_STATE_DIR": str(state)}  # the suite's cache (baseline unpacked)
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(OWNER))
    done = subprocess.run([sys.executable, str(script), os.getcwd(), STOP_LOOP], env=env, capture_output=True,
                          text=True, timeout=50, cwd=os.getcwd())
    assert done.returncode == -signal.SIGKILL and "ready" in done.stdout, done.stderr[-2000:]
    assert_host_clean(state, timeout=30)
