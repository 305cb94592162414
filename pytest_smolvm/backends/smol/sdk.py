"""Every use of the smolmachines SDK that its public API does not promise, in one place.

Read from smolmachines ``SDK_VERSION_READ``. When the installed version differs,
``private_api_problems()`` says what no longer holds, and tests/test_smol_sdk.py fails
loudly: re-read the SDK source named in each function and update this module.

Importing this module does not import ``smol`` (importing ``smol`` mutates ``os.environ``).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smol import ExecOptions, Machine

SDK_VERSION_READ = "1.32.2"


def installed_version() -> str | None:
    try:
        return version("smolmachines")
    except PackageNotFoundError:
        return None


def exec_cancellable(machine: Machine, command: list[str],
                     opts: ExecOptions) -> tuple[Any, Callable[[], Any]] | tuple[None, None]:
    """``(canceller, run)`` for an exec another thread can kill, or ``(None, None)``.

    ``Machine._exec_cancellable`` (machine.py:399-406) is private: it wraps the local
    transport's ``canceller()`` (transport.py:792-794) so a host-side timer can kill a command
    whose guest agent never enforced its timeout. The cloud has no canceller (None, None).
    """
    make = getattr(machine, "_exec_cancellable", None)
    if make is None:
        return None, None
    canceller, run = make(command, opts)
    if canceller is None:
        return None, None
    return canceller, run


def vm_data_dir(name: str) -> Path:
    """Where the local engine keeps a machine's disks and logs.

    ``$XDG_CACHE_HOME/smolvm/vms/<sha256(name)[:16]>`` ("hash-derived, not name-derived",
    ``smol-vmm machine data-dir --help``); the SDK has no call for it, and the engine deletes
    it with the machine, so logs are read from here before a delete.
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "smolvm" / "vms" / hashlib.sha256(name.encode()).hexdigest()[:16]


def remove_fork_lock(name: str) -> None:
    """Remove the ``.<name>.fork-operation.lock`` the engine leaves next to the data dirs for
    every name it deleted (seen on 1.32.2, even for names that never existed).

    Names here are unique per machine, so once the machine is gone nobody can want its lock.
    """
    with contextlib.suppress(OSError):
        (vm_data_dir(name).parent / f".{name}.fork-operation.lock").unlink()


def private_api_problems() -> list[str]:
    """What this module relies on that the installed SDK no longer offers (empty: all holds)."""
    installed = installed_version()
    if installed is None:
        return ["smolmachines is not installed"]
    problems = []
    if installed != SDK_VERSION_READ:
        problems.append(f"smolmachines {installed} is installed but pytest_smolvm.backends.smol.sdk.py was "
                        f"read from {SDK_VERSION_READ}: re-read the SDK and update it")
    from smol import Machine
    from smol.transport import LocalTransport

    make = getattr(Machine, "_exec_cancellable", None)
    if make is None:
        problems.append("Machine._exec_cancellable is gone")
    elif list(inspect.signature(make).parameters) != ["self", "command", "opts"]:
        problems.append(f"Machine._exec_cancellable{inspect.signature(make)} changed shape")
    if not callable(getattr(LocalTransport, "canceller", None)):
        problems.append("LocalTransport.canceller is gone")
    return problems
