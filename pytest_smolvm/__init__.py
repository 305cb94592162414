"""pytest-smolvm: a fresh, isolated guest for every test, destroyed on every path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_smolvm.errors import (
    ExecError,
    GuestError,
    GuestUserError,
    MarkerError,
    ProvisionError,
    SmolVMError,
    SmolVMWarning,
    UsageError,
)

if TYPE_CHECKING:
    from pytest_smolvm.evals.episodes import episode_seed, read_results
    from pytest_smolvm.handle.aio import AsyncVM
    from pytest_smolvm.handle.vm import VM, ExecResult
    from pytest_smolvm.session.library import Session

__all__ = ["VM", "AsyncVM", "ExecError", "ExecResult", "GuestError", "GuestUserError", "MarkerError", "ProvisionError",
           "Session", "SmolVMError", "SmolVMWarning", "UsageError", "episode_seed",
           "read_results"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The handle's modules are imported on first use: pytest imports this package for every run
    # of every project that has the plugin installed, most of which never touch a guest.
    if name in ("VM", "ExecResult"):
        from pytest_smolvm.handle import vm

        return getattr(vm, name)
    if name == "AsyncVM":
        from pytest_smolvm.handle.aio import AsyncVM

        return AsyncVM
    if name in ("episode_seed", "read_results"):
        from pytest_smolvm.evals import episodes

        return getattr(episodes, name)
    if name == "Session":
        from pytest_smolvm.session.library import Session

        return Session
    raise AttributeError(f"module 'pytest_smolvm' has no attribute {name!r}")
