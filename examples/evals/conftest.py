"""Hooks for the eval suite."""

import pytest

from pytest_smolvm import VM


def pytest_smolvm_collect_artifacts(item: pytest.Item, vm: VM) -> list[str]:
    # Saved under --smol-artifacts=DIR/<test id>/files/ when an episode fails (or with
    # --smol-logs=always): the agent's answer, copied out before the guest is destroyed.
    return ["/workspace"]
