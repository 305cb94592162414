"""Warm baselines: the setup (hook and commands) that every test's guest inherits.

The setup's identity (the source of every ``pytest_smolvm_prepare_baseline`` implementation
plus the ``smol_baseline_setup`` commands) is part of the warm baseline's cache key: edit the
setup and the next run prepares a new one; leave it and runs reuse the cached one.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from pytest_smolvm.errors import UsageError
from pytest_smolvm.handle.vm import VM

SETUP_KEY = pytest.StashKey["BaselineSetup"]()


@dataclass(frozen=True)
class BaselineSetup:
    """What turns a baseline into a warm one: the prepare hook, then setup commands."""

    run_hook: Callable[[VM], None] | None = None
    commands: tuple[str, ...] = ()
    identity: str = ""  # changes whenever the hook's source or the commands change

    def __bool__(self) -> bool:
        return self.run_hook is not None or bool(self.commands)

    @classmethod
    def from_config(cls, config: pytest.Config, commands: Sequence[str]) -> BaselineSetup:
        """This session's setup (computed once per distinct command list)."""
        if isinstance(commands, str) or not all(isinstance(c, str) for c in commands):
            raise UsageError(f"smol_baseline_setup must return a list of shell commands, got {commands!r}")
        cached = config.stash.get(SETUP_KEY, None)
        if cached is not None and cached.commands == tuple(commands):
            return cached
        impls = config.hook.pytest_smolvm_prepare_baseline.get_hookimpls()
        identity = hashlib.sha256()
        for impl in impls:
            try:
                identity.update(inspect.getsource(impl.function).encode())
            except (OSError, TypeError):
                identity.update(impl.function.__qualname__.encode())
        for command in commands:
            identity.update(b"\0" + command.encode())

        def run_hook(vm: VM) -> None:
            config.hook.pytest_smolvm_prepare_baseline(vm=vm, config=config)

        setup = cls(run_hook if impls else None, tuple(commands), identity.hexdigest())
        config.stash[SETUP_KEY] = setup
        return setup


