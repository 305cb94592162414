"""The one place a guest's spec is resolved: the run's :class:`Settings` and a test's
:class:`MarkerSpec` become the :class:`VMSpec` its backend makes and its handle applies.

Where each concern lives: user input is validated in ``settings.py`` (options, ini, marker and
factory keywords, each with its one-line error); default limits are ``limits.LIMITS``, read
here when a guest is resolved (so a conftest that replaces ``LIMITS`` applies to the guests
made after it); every fallback (marker over option over default) is applied here and nowhere
else. The pool resolves a spec once per guest; a branch's children copy their parent's
(:func:`child`); the handle takes its user, output limit and exec timeout from the spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pytest_smolvm import limits
from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.baselines.baseline import Baseline
from pytest_smolvm.session.settings import MarkerSpec, Settings

NAMED_LIMITS = ("cpus", "memory_mb")  # a test may name them; VMSpec.defaulted lists those it did not


def resolve(settings: Settings, marker: MarkerSpec, *, name: str, baseline: Baseline,
            labels: Mapping[str, str]) -> VMSpec:
    """``marker`` over ``settings`` over the default limits, for the guest ``name``."""
    defaults = limits.LIMITS  # read now, per guest: never bound at import
    relaxed = "limits" in marker.relax  # no default CPU and memory limits (a marker's own still apply)
    return VMSpec(
        name=name, baseline=baseline,
        cpus=marker.cpus if marker.cpus is not None else (None if relaxed else defaults.cpus),
        memory_mb=marker.memory_mb if marker.memory_mb is not None else (None if relaxed else defaults.memory_mb),
        defaulted=tuple(key for key in NAMED_LIMITS if getattr(marker, key) is None), disk_mb=defaults.disk_mb,
        network=marker.network, allow_hosts=tuple(marker.allow_hosts), env=dict(marker.env),
        labels=dict(labels), relax=tuple(marker.relax), branchable=marker.branchable,
        user=marker.user if marker.user is not None else settings.user,
        output_limit=_first(marker.output_limit, settings.output_limit, defaults.output_bytes),
        timeout=marker.timeout)


def _first(*values: int | None) -> int:
    return next(value for value in values if value is not None)


def child(parent: VMSpec, name: str, *, branchable: bool) -> VMSpec:
    """A branch of the guest ``parent`` describes: the same guest under its own name, labelled
    with its parent's (a branch starts from its parent's state, limits and user alike)."""
    return dataclasses.replace(parent, name=name, branchable=branchable,
                               labels={**parent.labels, "parent": parent.name})
