"""Fixtures for the hostile-guest suite: namespace guests made directly, and a static probe.

The suite runs as root here and, through test_unprivileged_attacks.py, as ``nobody`` (guests
in a user namespace): the same tests, so every boundary is checked in both modes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pytest_smolvm.backends.base import Guest, VMSpec
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.baselines.baseline import Baseline, resolve
from pytest_smolvm.handle.vm import VM
from tests import tools
from tests.leaks import assert_host_clean

HOST_SECRET_VAR = "SMOLVM_SUITE_HOST_SECRET"
PROBE_SOURCE = Path(__file__).with_name("probe.c")


@pytest.fixture(scope="session")
def host_secret() -> str:
    return secrets.token_hex(16)


@pytest.fixture(scope="session")
def security_env(tmp_path_factory: pytest.TempPathFactory, host_secret: str) -> Iterator[Path]:
    """Private state and cache dirs, and a secret in this process's environment (the guests'
    helper must not carry it anywhere a guest can read)."""
    state = tmp_path_factory.mktemp("sec-state")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_SMOLVM_STATE_DIR", str(state))
        mp.setenv("PYTEST_SMOLVM_CACHE_DIR", os.environ.get("SMOLVM_SUITE_CACHE")
                  or str(tmp_path_factory.mktemp("sec-cache")))
        mp.setenv(HOST_SECRET_VAR, host_secret)
        yield state


@pytest.fixture(scope="session")
def ns_backend(security_env: Path) -> Iterator[NamespaceBackend]:
    probe = NamespaceBackend.probe()
    if not probe.available:
        pytest.skip(f"namespace backend unavailable: {probe.reason}")
    backend = NamespaceBackend()
    yield backend
    backend.close()
    assert_host_clean(security_env)


@pytest.fixture(scope="session")
def baseline(ns_backend: NamespaceBackend) -> Baseline:
    found = resolve(None, Path.cwd())
    ns_backend.rootfs(found)  # unpacked once, before any test times anything
    return found


@pytest.fixture
def make_vm(ns_backend: NamespaceBackend, baseline: Baseline) -> Iterator[Callable[..., VM]]:
    made: list[VM] = []

    def make(**spec: object) -> VM:
        guest = ns_backend.create(VMSpec(name=f"sec-{uuid.uuid4().hex[:10]}", baseline=baseline,
                                         **spec))  # type: ignore[arg-type]
        vm = VM(guest, backend="namespace", isolation="namespace")
        made.append(vm)
        return vm

    yield make
    for vm in made:
        vm._guest.destroy()


@pytest.fixture
def vm(make_vm: Callable[..., VM]) -> VM:
    return make_vm()


@pytest.fixture(scope="session")
def probe_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The static syscall probe, built here (gcc and a static libc are in .ci/run)."""
    gcc = tools.require("gcc", "to build the static syscall probe")
    out = tmp_path_factory.mktemp("probe") / "probe"
    result = subprocess.run([gcc, "-static", "-O1", "-o", str(out), str(PROBE_SOURCE)],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        tools.missing("libc6-dev", f"gcc -static failed: {result.stderr.strip()[-300:]}")
    return out


@pytest.fixture
def probe(vm: VM, probe_binary: Path) -> Callable[..., dict[str, str]]:
    """Run the probe in ``vm`` (or another guest) with some attacks; their outcomes by name."""
    def run(*attacks: str, guest: VM | None = None) -> dict[str, str]:
        target = guest or vm
        target.copy_in(probe_binary, "/probe")
        result = target.exec(["/probe", *attacks], timeout=60)
        assert result.exit_code == 0, result.stderr
        return dict(line.split(" ", 1) for line in result.stdout.splitlines())
    return run


@pytest.fixture
def warm_baseline(ns_backend: NamespaceBackend, baseline: Baseline) -> Callable[[str], Baseline]:
    """``warm_baseline(script)``: a warm baseline made as a run makes one, the guest running ``script``
    (a hostile warm-up), exported and unpacked into the cache."""
    def make(script: str) -> Baseline:
        def populate(guest: Guest) -> None:
            VM(guest, backend="namespace", isolation="namespace").exec(script, check=True)

        @contextlib.contextmanager
        def scratch_guest(base: Baseline) -> Iterator[Guest]:
            guest = ns_backend.create(VMSpec(name=f"sec-warm-{uuid.uuid4().hex[:8]}", baseline=base))
            try:
                yield guest
            finally:
                guest.destroy()

        return ns_backend.derive_baseline(baseline, uuid.uuid4().hex, populate, scratch_guest)
    return make
