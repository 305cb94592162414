"""pytest-smolvm: a fresh, isolated guest for every test, destroyed on every path."""

from pytest_smolvm.errors import ExecError, GuestError, ProvisionError, SmolVMError, UsageError
from pytest_smolvm.vm import VM, ExecResult

__all__ = ["VM", "ExecError", "ExecResult", "GuestError", "ProvisionError", "SmolVMError", "UsageError"]
__version__ = "0.1.0"
