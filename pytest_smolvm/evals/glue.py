"""What the episodes plugin needs of the pytest plugin above it, handed down by plugin/hooks.py.

evals sits below plugin (docs/architecture.md): it imports no plugin module, so the xdist
hand-over and the test's artifacts reach it as these values, not as imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_smolvm.session.live import LiveGuest


@dataclass(frozen=True)
class PluginGlue:
    worker_input: Callable[[pytest.Config], dict[str, Any] | None]  # None in the controller, or without xdist
    tell_workers: Callable[[pytest.Config, str, Callable[[], str]], None]  # a value the controller sends each worker
    results_path: str  # the workerinput key of the controller's resolved --smol-results path
    result_attr: str  # the teardown report's attribute that carries its result line to the controller
    finished_guests: Callable[[pytest.Item], list[LiveGuest]]  # every guest the test had
    saved_dir: Callable[[pytest.Item], str | None]  # the test's artifacts directory, if it has files
