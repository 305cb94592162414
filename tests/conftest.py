from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_smolvm.baselines.cache import force_rmtree
from tests.leaks import assert_host_clean

if TYPE_CHECKING:
    from tests.smolcloud.harness import LoopbackCloud

pytest_plugins = ["pytester", "tests.registry_fixtures"]
TEST_TIMEOUT = 300  # seconds: a hung scenario fails instead of stalling CI


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One baseline cache for the whole test session: the bundled rootfs is unpacked once."""
    return tmp_path_factory.mktemp("smolvm-cache")


@pytest.fixture(scope="session")
def smol_engine_home() -> Iterator[Path]:
    """One short XDG home for the smol engine, whatever HOME pytester gives a run.

    The engine keeps sockets under its cache dir (a 107-byte path limit) and unpacks its guest
    rootfs once per cache dir: a fresh HOME per run would pay that every time. Removed at the
    end of the session: that rootfs is ~36 MB, and every session (every xdist worker) has one.
    """
    home = Path(tempfile.mkdtemp(prefix="smolx-"))
    yield home
    force_rmtree(home)


@pytest.fixture
def smol_state(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory,
               shared_cache: Path, smol_engine_home: Path) -> Iterator[Path]:
    """A private registry/scratch dir for the runs this test starts; checked for leaks after."""
    state = tmp_path_factory.mktemp("smolvm-state")
    monkeypatch.setenv("PYTEST_SMOLVM_STATE_DIR", str(state))
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(shared_cache))
    monkeypatch.delenv("SMOL_CLOUD_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(smol_engine_home / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(smol_engine_home / "d"))
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    yield state
    assert_host_clean(state)


@pytest.fixture
def cli(smol_state: Path) -> object:
    """Run the ``pytest-smolvm`` command as users do."""
    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", *args], capture_output=True,
                              text=True, timeout=timeout, env=os.environ.copy())
    return run


@pytest.fixture(autouse=True)
def _children_without_hypothesis(request: pytest.FixtureRequest) -> None:
    # Hypothesis's pytest plugin imports all of hypothesis at every run's terminal summary:
    # ~0.6-1.2 s of CPU in each pytest a test starts, hundreds of them in this suite, and no test
    # here is about hypothesis (the fuzz tests use it in this process).
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester").plugins.append("no:hypothesispytest")


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackCloud]:
    """The loopback smol cloud (tests/smolcloud/), one per test module; it must end with nothing
    of its machines left."""
    pytest.importorskip("smol")
    from tests.leaks import leftovers
    from tests.smolcloud.harness import LoopbackCloud

    server = LoopbackCloud(state_dir=tmp_path_factory.mktemp("smolcloud-state"))
    yield server
    status, err = server.stop()
    assert status == 0, err
    assert server.state_dir is not None and leftovers(server.state_dir) == {}


@pytest.fixture
def token(cloud: LoopbackCloud, smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Points this test's runs at the loopback cloud with a token of its own."""
    mine = f"tok-{uuid.uuid4().hex[:12]}"
    for key, value in cloud.env(mine).items():
        monkeypatch.setenv(key, value)
    return mine
