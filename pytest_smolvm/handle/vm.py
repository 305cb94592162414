"""The VM handle tests use: a guest's operations (:mod:`.base`) plus its async twin as ``.aio``."""

from __future__ import annotations

import functools

from pytest_smolvm.handle.aio import AsyncVM
from pytest_smolvm.handle.base import GuestHandle
from pytest_smolvm.handle.result import DEFAULT, ExecResult, Timeout, TranscriptEntry

__all__ = ["DEFAULT", "VM", "ExecResult", "Timeout", "TranscriptEntry"]


class VM(GuestHandle):
    """A fresh guest for one test. Every method talks to that guest only."""

    @functools.cached_property
    def aio(self) -> AsyncVM:
        """This guest as an async handle: ``await smol_vm.aio.exec(...)``."""
        return AsyncVM(self)

    def __repr__(self) -> str:
        return f"<VM {self.name} backend={self.backend}>"
