"""The plugin's own hooks. Implement them in a conftest.py or a plugin."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_smolvm.vm import VM


def pytest_smolvm_configure_vm(item: pytest.Item, spec: dict[str, Any]) -> None:
    """Adjust a guest's settings before it is made.

    ``spec`` holds the ``smol`` marker keywords resolved for this guest (image, cpus,
    memory_mb, network, allow_hosts, timeout, env); change it in place. The result is
    validated like a marker.
    """


def pytest_smolvm_vm_ready(item: pytest.Item, vm: VM) -> None:
    """A guest for ``item`` is up; runs before the test (or the factory's caller) gets it."""
