"""What the smol backend relies on beyond the SDK's public API still holds in the installed SDK.

When this fails after an SDK upgrade: re-read the SDK source named in pytest_smolvm/backends/smol/sdk.py,
update that module (and SDK_VERSION_READ), and the loopback cloud's shapes (tests/smolcloud/wire.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_smolvm.backends.smol import sdk as smol_sdk
from pytest_smolvm.backends.smol.backend import owner_alive
from pytest_smolvm.host.procs import process_start_time

pytest.importorskip("smol")


def test_private_sdk_uses_still_hold() -> None:
    assert smol_sdk.private_api_problems() == []


def test_the_loopback_cloud_was_read_from_the_same_sdk() -> None:
    from tests.smolcloud import wire

    assert wire.SDK_VERSION == smol_sdk.SDK_VERSION_READ == smol_sdk.installed_version()


def test_a_changed_private_api_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from smol import Machine

    monkeypatch.setattr(smol_sdk, "SDK_VERSION_READ", "0.0.1")
    monkeypatch.delattr(Machine, "_exec_cancellable")
    problems = smol_sdk.private_api_problems()
    assert any("0.0.1" in p for p in problems) and any("_exec_cancellable" in p for p in problems)


def test_exec_cancellable_is_none_on_the_cloud_shape() -> None:
    class CloudLike:  # a Machine whose transport has no canceller: what the cloud gives
        def _exec_cancellable(self, command: list[str], opts: object) -> tuple[None, None]:
            return None, None

    assert smol_sdk.exec_cancellable(CloudLike(), ["true"], object()) == (None, None)  # type: ignore[arg-type]


def test_owner_alive_needs_the_same_process_not_just_the_pid() -> None:
    me = os.getpid()
    assert owner_alive({"owner_pid": str(me), "owner_start": str(process_start_time(me))})
    assert not owner_alive({"owner_pid": str(me), "owner_start": "1"})  # a reused pid
    assert not owner_alive({"owner_pid": "0"}) and not owner_alive({"owner_pid": "x"})
    # a boot probe labelled without a start time: alive while its pid is
    assert owner_alive({"owner_pid": str(me)})
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert not owner_alive({"owner_pid": gone})


# pytest's own writes to the environment (it sets PYTEST_CURRENT_TEST at each phase and removes it
# after each test), against the lookup the SDK makes before every cloud request, on another thread.
ENVIRON_RACE = """
import os, sys, threading, time, urllib.request
if sys.argv[1] == "guarded":
    from pytest_smolvm.backends.smol import proxy_lookup
    proxy_lookup.install()
errors, stop = [], threading.Event()

def lookups():
    while not stop.is_set():
        try:
            urllib.request.getproxies()
        except (KeyError, RuntimeError) as exc:
            errors.append(exc)

reader = threading.Thread(target=lookups)
reader.start()
deadline = time.monotonic() + 1.0
while time.monotonic() < deadline:
    os.environ["PYTEST_CURRENT_TEST"] = "test_x.py::test_x (call)"
    os.environ.pop("PYTEST_CURRENT_TEST")
stop.set()
reader.join()
print(len(errors))
"""


def test_the_sdks_proxy_lookup_survives_pytest_changing_the_environment() -> None:
    def failed_lookups(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", ENVIRON_RACE, mode], capture_output=True, text=True,
                              timeout=60, cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert failed_lookups("plain") > 0  # the race is real on this host (tens a second, measured)
    assert failed_lookups("guarded") == 0


def test_the_cloud_backend_guards_the_proxy_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.request

    from pytest_smolvm.backends.base import BackendOptions
    from pytest_smolvm.backends.smol.backend import SmolBackend

    # The plain lookup, as in a process where no cloud backend was made yet (another test's may have been).
    plain = getattr(urllib.request.getproxies, "__wrapped__", urllib.request.getproxies)
    monkeypatch.setattr(urllib.request, "getproxies", plain)  # undone after the test
    monkeypatch.setenv("SMOL_CLOUD_TOKEN", "not-used")
    SmolBackend(BackendOptions(target="cloud"))
    assert urllib.request.getproxies is not plain and urllib.request.getproxies.__wrapped__ is plain  # type: ignore[attr-defined]
    SmolBackend(BackendOptions(target="cloud"))  # a second backend does not wrap the lookup twice
    assert urllib.request.getproxies.__wrapped__ is plain  # type: ignore[attr-defined]


def test_a_conftest_that_replaces_limits_changes_the_smol_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: the defaults were bound as default arguments at import, so replacing
    ``limits.LIMITS`` (as limits.py tells a conftest to) changed nothing here."""
    import dataclasses

    from pytest_smolvm import limits
    from pytest_smolvm.backends.base import BackendOptions
    from pytest_smolvm.backends.smol.backend import SmolBackend

    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, cpus=3, memory_mb=777, smol_ready=9.0))
    backend = SmolBackend(BackendOptions(target="local"))
    try:
        assert (backend.default_cpus, backend.default_memory_mb, backend.ready_timeout) == (3, 777, 9.0)
    finally:
        backend.close()
