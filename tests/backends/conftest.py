"""One fixture, ``vm_factory``, parametrized over every built-in backend.

Each backend instance lives for the session (a smol source boots once), with the baseline
cache shared by the whole session and each test's state dir private to that test. A backend
that cannot run here is skipped with the probe's exact reason (see it with ``-rs``).

``smol-cloud`` is the smol backend on its cloud target, pointed at the loopback smol cloud
(``tests/smolcloud``): the real SDK and the real backend code, on any Linux host.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pytest_smolvm.backends import backend_class
from pytest_smolvm.backends.base import Backend, BackendOptions, Guest, VMSpec
from pytest_smolvm.backends.smol.boot_failures import plain_reason
from pytest_smolvm.baselines.baseline import Baseline, resolve
from pytest_smolvm.handle.vm import VM
from tests.leaks import leftovers
from tests.smolcloud.harness import LoopbackCloud

BACKENDS = ("namespace", "smol", "smol-cloud")
RUN_ID = uuid.uuid4().hex[:12]


@pytest.fixture(scope="session")
def backends_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("backends-cache")


@pytest.fixture(scope="session")
def session_env(backends_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_SMOLVM_CACHE_DIR", str(backends_cache))
        mp.setenv("PYTEST_SMOLVM_STATE_DIR", str(tmp_path_factory.mktemp("backends-state")))
        # A token in the environment must never send these tests to the (billed) cloud.
        mp.delenv("SMOL_CLOUD_TOKEN", raising=False)
        yield


@pytest.fixture(scope="session")
def baseline(session_env: None) -> Baseline:
    return resolve(None, Path.cwd())


# A loopback smol cloud the caller started (a test that runs this suite and then checks the
# server): read before session_env clears the token. Only a loopback URL is ever taken.
EXTERNAL_CLOUD = (os.environ.get("SMOL_CLOUD_URL", ""), os.environ.get("SMOL_CLOUD_TOKEN", ""))


@pytest.fixture(scope="session")
def loopback_cloud(session_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackCloud]:
    """The loopback smol cloud for this session; it must hold nothing once the backend closed."""
    url, token = EXTERNAL_CLOUD
    if url.startswith("http://127.0.0.1:") and token:
        yield LoopbackCloud(attach=url, token=token)
        return
    cloud = LoopbackCloud(state_dir=tmp_path_factory.mktemp("smolcloud-state"))
    try:
        yield cloud
    finally:
        status, err = cloud.stop()
        assert status == 0, f"smolcloud exited {status}: {err}"
        assert cloud.state_dir is not None and leftovers(cloud.state_dir) == {}


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest, session_env: None, baseline: Baseline) -> Iterator[Backend]:
    name = request.param
    instance: Backend
    with pytest.MonkeyPatch.context() as mp:
        if name == "smol-cloud":
            cloud: LoopbackCloud = request.getfixturevalue("loopback_cloud")
            for key, value in cloud.env().items():
                mp.setenv(key, value)
            baseline = Baseline("alpine", "registry", None, "alpine")
        else:
            verdict = backend_class(name).probe()
            if not verdict.available:
                # The engine's words vary from boot to boot on one host: the stable, whole reason
                # here, the engine's own in 'pytest-smolvm doctor'.
                why = plain_reason(verdict.reason) if name == "smol" else verdict.reason
                pytest.skip(f"{name} backend unavailable: {why} (pytest-smolvm doctor says more)")
        target = "cloud" if name == "smol-cloud" else "local"
        if name.startswith("smol"):
            from pytest_smolvm.backends.smol.backend import SmolBackend

            instance = SmolBackend(BackendOptions(target=target, labels={"run": RUN_ID, "worker": "conformance"}))
        else:
            instance = backend_class(name)()
        instance.prepare_run(baseline)
        yield instance
        instance.close()
        if name.startswith("smol"):
            from pytest_smolvm.backends.smol.backend import list_owned

            left = [m.name for m in list_owned({"pytest-smolvm": "1", "run": RUN_ID}, target=target)]
            assert left == [], f"smol machines outlived the backend's close(): {left}"
        if name == "smol-cloud":
            left_on_server = cloud.wait_for_no_machines(token=cloud.token, labels={"run": RUN_ID})
            assert left_on_server == [], "the loopback cloud still holds this session's machines"


@pytest.fixture(scope="session")
def backend_baseline(backend: Backend, baseline: Baseline) -> Baseline:
    """The baseline guests of ``backend`` are made from (the cloud boots a registry image)."""
    target = getattr(backend, "target", "local")
    return Baseline("alpine", "registry", None, "alpine") if target == "cloud" else baseline


@pytest.fixture
def guest_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, session_env: None) -> Path:
    """A private state dir for this test's guests (scratch dirs and the like)."""
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("PYTEST_SMOLVM_STATE_DIR", str(state))
    return state


MakeGuest = Callable[..., tuple[VM, Guest]]


@pytest.fixture
def make_guest(backend: Backend, backend_baseline: Baseline, guest_state: Path) -> Iterator[MakeGuest]:
    """``make_guest(**spec) -> (VM, Guest)``; every guest made is destroyed at teardown."""
    made: list[Guest] = []

    def make(**overrides: object) -> tuple[VM, Guest]:
        name = f"pytest-smolvm-conf-{uuid.uuid4().hex[:12]}"
        labels = {"pytest-smolvm": "1", "run": RUN_ID, "worker": "conformance", "owner_pid": str(os.getpid())}
        spec = VMSpec(name=name, baseline=backend_baseline, labels=labels, **overrides)  # type: ignore[arg-type]
        guest = backend.create(spec)
        made.append(guest)
        return VM(guest, backend=backend.name, isolation=backend.isolation), guest

    yield make
    errors = []
    for guest in made:
        try:
            guest.destroy()
        except Exception as exc:  # report every leak, not just the first
            errors.append(f"{guest.name}: {exc}")
    assert not errors, f"destroy failed: {errors}"


@pytest.fixture
def vm(make_guest: MakeGuest) -> VM:
    return make_guest()[0]
