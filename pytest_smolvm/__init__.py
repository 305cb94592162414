"""pytest-smolvm: a fresh, isolated guest for every test, destroyed on every path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_smolvm.errors import ExecError, GuestError, ProvisionError, SmolVMError, UsageError

if TYPE_CHECKING:
    from pytest_smolvm.vm import VM, ExecResult

__all__ = ["VM", "ExecError", "ExecResult", "GuestError", "ProvisionError", "SmolVMError", "UsageError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The handle's module is imported on first use: pytest imports this package for every run
    # of every project that has the plugin installed, most of which never touch a guest.
    if name in ("VM", "ExecResult"):
        from pytest_smolvm import vm

        return getattr(vm, name)
    raise AttributeError(f"module 'pytest_smolvm' has no attribute {name!r}")
