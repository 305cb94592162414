"""Backends: how guests are made. ``base`` is the protocol; this module picks a backend by name.

``namespace/`` (Linux namespaces + overlayfs) and ``smol/`` (smolmachines microVMs, local or cloud)
are the built-in ones; others register under the ``pytest_smolvm.backends`` entry-point group.
Code outside ``backends/`` imports ``base`` and :func:`backend_class`, never a backend's modules.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from pytest_smolvm.errors import UsageError

if TYPE_CHECKING:
    from pytest_smolvm.backends.base import Backend

ENTRY_POINT_GROUP = "pytest_smolvm.backends"
BUILTIN_BACKENDS = {
    "namespace": "pytest_smolvm.backends.namespace.backend:NamespaceBackend",
    "smol": "pytest_smolvm.backends.smol.backend:SmolBackend",
}


def backend_class(name: str) -> type[Backend]:
    """The class registered for ``name``: built in, or from the ``pytest_smolvm.backends`` group."""
    target = BUILTIN_BACKENDS.get(name)
    if target is None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == name:
                cls: type[Backend] = ep.load()
                return cls
        known = sorted({*BUILTIN_BACKENDS, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})
        raise UsageError(f"--smol-backend={name}: unknown backend (choose auto, {', '.join(known)})")
    module_name, _, attr = target.partition(":")
    found: type[Backend] = getattr(importlib.import_module(module_name), attr)
    return found
