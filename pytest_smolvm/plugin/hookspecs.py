"""The plugin's own hooks. Implement them in a conftest.py or a plugin."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_smolvm.handle.vm import VM


def pytest_smolvm_configure_vm(item: pytest.Item, spec: dict[str, Any]) -> None:
    """Adjust a guest's settings before it is made.

    ``spec`` holds the ``smol`` marker keywords resolved for this guest (image, cpus,
    memory_mb, network, allow_hosts, timeout, env); change it in place. The result is
    validated like a marker.
    """


def pytest_smolvm_vm_ready(item: pytest.Item, vm: VM) -> None:
    """A guest for ``item`` is up; runs before the test (or the factory's caller) gets it."""


def pytest_smolvm_collect_artifacts(item: pytest.Item, vm: VM) -> Iterable[str] | None:
    """Guest paths (files or trees) to save for ``item`` before ``vm`` is destroyed.

    Called once per guest, only when ``--smol-artifacts`` is set and the test's logs are being
    kept (it failed, or ``--smol-logs=always``). Every implementation's paths are copied out
    with ``vm.copy_out`` (symlink-safe) under ``DIR/<test id>/files/``.
    """


def pytest_smolvm_prepare_baseline(vm: VM, config: pytest.Config) -> None:
    """Make the warm state every test inherits: install packages, write files, start services.

    Runs once per host per baseline (and per version of this setup: the source of every
    implementation is part of the warm baseline's cache key), in a guest made from the plain
    baseline, before anything is forked from it. What the guest's filesystem holds afterwards
    is what every test's guest starts with. Raise (or ``vm.exec(..., check=True)``) to fail:
    the run stops once, with this setup's transcript.
    """
