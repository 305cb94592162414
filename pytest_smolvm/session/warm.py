"""Warm baselines: the setup (hook and commands) that every test's guest inherits.

The setup's identity (the source of every ``pytest_smolvm_prepare_baseline`` implementation
plus the ``smol_baseline_setup`` commands) is part of the warm baseline's cache key: edit the
setup and the next run prepares a new one; leave it and runs reuse the cached one.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import pytest

from pytest_smolvm.backends.base import Backend, Guest
from pytest_smolvm.baselines.baseline import Baseline
from pytest_smolvm.errors import BaselineSetupError, UsageError
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.inert import inert
from pytest_smolvm.session.plan import RunPlan

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


class WarmBaselines:
    """The warm baselines this process prepared, by key; a failed setup is remembered, not retried."""

    def __init__(self) -> None:
        self._known: dict[str, Baseline | BaselineSetupError] = {}

    def prepare(self, base: Baseline, setup: BaselineSetup, backend: Backend, plan: RunPlan,
                scratch_guest: Callable[[Baseline], AbstractContextManager[Guest]]) -> Baseline:
        key = hashlib.sha256(f"{base.digest}\0{setup.identity}".encode()).hexdigest()
        known = self._known.get(key)
        if isinstance(known, BaselineSetupError):
            raise BaselineSetupError(f"the baseline setup already failed in this run: {known}")
        if known is not None:
            return known

        def populate(guest: Guest) -> None:
            vm = VM(guest, backend=plan.backend, isolation=plan.isolation, baseline=base.reference,
                    digest=base.digest)
            try:
                if setup.run_hook is not None:
                    setup.run_hook(vm)
                for command in setup.commands:
                    vm.exec(command, check=True)
            except Exception as exc:
                raise BaselineSetupError(inert(f"{type(exc).__name__}: {exc}\n--- setup transcript\n"
                                               f"{vm.transcript_text()}")) from exc

        try:
            warm = backend.derive_baseline(base, key, populate, scratch_guest)
        except BaselineSetupError as exc:
            self._known[key] = exc
            raise
        self._known[key] = warm
        return warm
