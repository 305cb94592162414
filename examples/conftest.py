"""The plugin's own hooks, implemented for this example suite."""

from typing import Any

import pytest


def pytest_smolvm_configure_vm(item: pytest.Item, spec: dict[str, Any]) -> None:
    # Runs before each guest is made; `spec` holds the resolved `smol` marker keywords.
    spec["env"] = {"SUITE": "examples", **spec["env"]}
