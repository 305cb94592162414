"""pytest-smolvm: a fresh, isolated guest for every test, destroyed on every path."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any


def _leave_our_modules_unrewritten() -> None:
    """Take this package off pytest's list of modules to rewrite the asserts of.

    pytest rewrites every module of an entry-point plugin's distribution as it is imported, and
    wherever it cannot cache the result (``PYTHONDONTWRITEBYTECODE``, a read-only site-packages:
    common in CI images) it parses and compiles each one again in every pytest process, ~0.2 s a
    process for the modules a guest test imports. This package holds no tests; its asserts are
    invariants, whose plain messages are enough. Runs first (pytest imports the package before
    the plugin module), so only this file is rewritten; a pytest without the private set it
    keeps leaves everything as it was.
    """
    for finder in sys.meta_path:
        marked, cache = getattr(finder, "_must_rewrite", None), getattr(finder, "_marked_for_rewrite_cache", None)
        if type(finder).__name__ == "AssertionRewritingHook" and isinstance(marked, set) and __name__ in marked:
            marked.discard(__name__)
            if isinstance(cache, dict):
                cache.clear()  # as pytest's own mark_rewrite does: decided again per name


_leave_our_modules_unrewritten()

from pytest_smolvm.errors import (  # noqa: E402  (after the call above: not rewritten)
    ExecError,
    GuestError,
    GuestFileNotFoundError,
    GuestUserError,
    MarkerError,
    ProvisionError,
    SmolVMError,
    SmolVMWarning,
    UsageError,
)

if TYPE_CHECKING:
    from pytest_smolvm.evals.episodes import episode_seed
    from pytest_smolvm.evals.lines import read_results
    from pytest_smolvm.handle.aio import AsyncVM
    from pytest_smolvm.handle.vm import VM, ExecResult
    from pytest_smolvm.session.library import Session

__all__ = ["VM", "AsyncVM", "ExecError", "ExecResult", "GuestError", "GuestFileNotFoundError", "GuestUserError",
           "MarkerError", "ProvisionError", "Session", "SmolVMError", "SmolVMWarning", "UsageError", "episode_seed",
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
    if name == "episode_seed":
        from pytest_smolvm.evals.episodes import episode_seed

        return episode_seed
    if name == "read_results":
        from pytest_smolvm.evals.lines import read_results

        return read_results
    if name == "Session":
        from pytest_smolvm.session.library import Session

        return Session
    raise AttributeError(f"module 'pytest_smolvm' has no attribute {name!r}")
