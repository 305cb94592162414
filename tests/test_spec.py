"""One resolved guest spec (session/spec.py): every fallback applied once, limits read when a
guest is made, never bound at import; the handle and a branch's children take the spec's values."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm import limits

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_smolvm"


# ------------------------------------------------------------------ nothing bound at import

def _reads_limits(node: ast.AST) -> Iterator[int]:
    """Lines where ``node``, evaluated at import, reads ``LIMITS`` (a lambda's body runs later;
    a function's body runs when called, its defaults and decorators at once)."""
    if isinstance(node, ast.Lambda):
        return
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args
        for part in [*node.decorator_list, *args.defaults, *(d for d in args.kw_defaults if d is not None)]:
            yield from _reads_limits(part)
        return
    if isinstance(node, ast.ImportFrom) and any(alias.name == "LIMITS" for alias in node.names):
        yield node.lineno  # a name bound to the object of the day: a later replacement is unseen
    if (isinstance(node, ast.Name) and node.id == "LIMITS" and isinstance(node.ctx, ast.Load)) \
            or (isinstance(node, ast.Attribute) and node.attr == "LIMITS"):
        yield node.lineno
        return
    for child in ast.iter_child_nodes(node):
        yield from _reads_limits(child)


def limits_read_at_import(source: str, where: str = "<source>") -> list[int]:
    return sorted(set(_reads_limits(ast.parse(source, where))))


def test_the_checker_finds_limits_bound_at_import() -> None:
    planted = (
        "from pytest_smolvm import limits\n"
        "from pytest_smolvm.limits import LIMITS\n"                      # 2: the object, bound
        "CAP = limits.LIMITS.read_bytes\n"                               # 3: module level
        "def f(x=limits.LIMITS.cpus, *, y=LIMITS.cpus): return limits.LIMITS.cpus\n"  # 4: defaults
        "class C:\n"
        "    n: int = limits.LIMITS.disk_mb\n"                           # 6: a dataclass field
        "    m: int = field(default_factory=lambda: limits.LIMITS.disk_mb)\n"  # read when made: fine
        "    def g(self): return limits.LIMITS.cpus\n")                  # read when called: fine
    assert limits_read_at_import(planted) == [2, 3, 4, 6]


def test_no_module_binds_a_limit_at_import() -> None:
    """A conftest that replaces ``limits.LIMITS`` must change every default: none may be a
    default argument, a class attribute or a module constant taken from it at import."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.name != "limits.py"
             for line in limits_read_at_import(path.read_text(), str(path))]
    assert found == [], "LIMITS read at import (read it when the value is needed): " + ", ".join(found)


class _Guest:
    name = "g"

    def __init__(self) -> None:
        self.asked: dict[str, Any] = {}

    def read_file(self, path: str, *, max_bytes: int | None = None, user: str | None = None) -> bytes:
        self.asked = {"path": path, "max_bytes": max_bytes}
        return b""


@pytest.fixture
def lowered(monkeypatch: pytest.MonkeyPatch) -> limits.Limits:
    """``LIMITS`` replaced after the package was imported, as a suite's conftest does."""
    from pytest_smolvm.backends import base  # noqa: F401 -- imported first, on purpose
    from pytest_smolvm.handle import vm  # noqa: F401

    new = dataclasses.replace(limits.LIMITS, cpus=1, memory_mb=300, disk_mb=24, output_bytes=5000,
                              read_bytes=1000)
    monkeypatch.setattr(limits, "LIMITS", new)
    return new


def test_defaults_of_a_spec_and_a_handle_are_read_when_made(lowered: limits.Limits) -> None:
    from pytest_smolvm.backends.base import VMSpec
    from pytest_smolvm.baselines.baseline import Baseline
    from pytest_smolvm.handle.vm import VM

    spec = VMSpec("n", Baseline("b", "rootfs-dir", None, "sha256:0"))
    assert (spec.disk_mb, spec.output_limit) == (24, 5000)
    guest = _Guest()
    vm = VM(guest)  # type: ignore[arg-type]
    assert vm.output_limit == 5000
    vm.read_file("/f")
    assert guest.asked["max_bytes"] == 1000


# ------------------------------------------------------------------ resolved once

def _base() -> Any:
    from pytest_smolvm.baselines.baseline import Baseline

    return Baseline("b", "rootfs-dir", None, "sha256:0")


def test_the_marker_wins_over_the_options_over_the_limits(lowered: limits.Limits) -> None:
    from pytest_smolvm.session.settings import MarkerSpec, Settings
    from pytest_smolvm.session.spec import child, resolve

    settings = Settings(user="nobody", output_limit=4096)
    plain = resolve(settings, MarkerSpec(), name="n", baseline=_base(), labels={"run": "r"})
    assert (plain.cpus, plain.memory_mb, plain.disk_mb) == (1, 300, 24)  # the limits of now
    assert (plain.user, plain.output_limit, plain.timeout) == ("nobody", 4096, None)
    marker = MarkerSpec().merged({"cpus": 3, "memory_mb": 700, "user": 0, "output_limit": "1k", "timeout": 9,
                                  "env": {"A": "1"}, "allow_hosts": ["pypi.org"], "branchable": True},
                                 "@pytest.mark.smol")
    spec = resolve(settings, marker, name="n", baseline=_base(), labels={})
    assert (spec.cpus, spec.memory_mb, spec.user, spec.output_limit, spec.timeout) == (3, 700, 0, 1024, 9.0)
    assert (dict(spec.env), spec.allow_hosts, spec.branchable) == ({"A": "1"}, ("pypi.org",), True)
    assert resolve(Settings(), MarkerSpec(), name="n", baseline=_base(), labels={}).output_limit == 5000
    # relax=["limits"]: no default CPU or memory limit (the backend applies none); a marker's own stays
    relaxed = resolve(settings, MarkerSpec(relax=("limits",), cpus=2.0), name="n", baseline=_base(), labels={})
    assert (relaxed.cpus, relaxed.memory_mb) == (2.0, None)
    kid = child(spec, "n-1", branchable=False)
    assert (kid.name, kid.labels["parent"], kid.branchable) == ("n-1", "n", False)
    assert dataclasses.replace(kid, name="n", branchable=True, labels={}) == spec


def test_the_default_output_limit_is_read_as_a_guest_is_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not when the settings were read: a Session made before a suite lowers ``LIMITS``."""
    from pytest_smolvm.session.settings import MarkerSpec, Settings
    from pytest_smolvm.session.spec import resolve

    early = Settings.from_keywords("Session")
    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, output_bytes=5000))
    assert resolve(early, MarkerSpec(), name="n", baseline=_base(), labels={}).output_limit == 5000


def test_the_backend_and_the_handles_get_the_one_resolved_spec(smol_state: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What the pool hands the backend carries every fallback; the handle and a branch's
    children read theirs from it (no second resolution in the pool or in branching)."""
    from pytest_smolvm.session import branching
    from pytest_smolvm.session.plan import Planner
    from pytest_smolvm.session.pool import GuestPool
    from pytest_smolvm.session.settings import MarkerSpec, Settings

    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, cpus=1, disk_mb=64))
    settings = Settings(backend="namespace", user="nobody", output_limit=4096, max_vms=4)  # max_vms: none made ahead
    planner = Planner(settings, "s" * 32, "main")
    pool = GuestPool(settings, planner, run_id="s" * 32, worker="main")
    try:
        backend = pool.backend
        created: list[Any] = []
        branched: list[Any] = []
        real_create, real_branch = backend.create, backend.branch  # type: ignore[attr-defined]

        def create(spec: Any, **kw: Any) -> Any:
            created.append(spec)
            return real_create(spec, **kw)

        def branch(parent: Any, specs: Any) -> Any:
            branched.extend(specs)
            return real_branch(parent, specs)

        monkeypatch.setattr(backend, "create", create)
        monkeypatch.setattr(backend, "branch", branch)
        live = pool.create("test_spec", MarkerSpec(timeout=7.0, output_limit=2048))
        [spec] = created
        assert (spec.cpus, spec.disk_mb, spec.user, spec.output_limit, spec.timeout) == (1, 64, "nobody", 2048, 7.0)
        vm = live.vm
        assert (vm.user, vm.output_limit, vm.default_timeout) == ("nobody", 2048, 7.0)
        assert vm.exec("id -un").stdout == "nobody\n"
        kids: list[Any] = []
        branching.own(vm, kids.append)
        kid = vm.branch()
        [kid_spec] = branched
        assert kid_spec == dataclasses.replace(spec, name=kid.name, labels={**spec.labels, "parent": vm.name})
        assert (kid.user, kid.output_limit, kid.default_timeout) == ("nobody", 2048, 7.0)
        disk_kib = [one.exec("df -k / | tail -1").stdout.split()[1] for one in (vm, kid)]
        assert disk_kib[0] == disk_kib[1] and 0.9 * 64 * 1024 <= int(disk_kib[0]) <= 64 * 1024  # the parent's disk
        for one in [*kids, live]:
            pool.destroy(one)
    finally:
        assert pool.close() == [] and planner.close() == []


# ------------------------------------------------------------------ as a suite uses it

CONFTEST_LOWERS_LIMITS = """
import dataclasses

from pytest_smolvm import VM, limits  # a conftest typing its fixtures imports the handle first
from pytest_smolvm.backends import base

limits.LIMITS = dataclasses.replace(limits.LIMITS, disk_mb=24, read_bytes=1000, output_bytes=64)
"""


def test_a_conftest_that_replaces_the_limits_after_import_is_honoured(pytester: pytest.Pytester,
                                                                      smol_state: Path) -> None:
    pytester.makeconftest(CONFTEST_LOWERS_LIMITS)
    pytester.makepyfile("""
        import errno

        import pytest

        def test_lowered(smol_vm):
            size_kib = int(smol_vm.exec("df -k / | tail -1").stdout.split()[1])
            assert 0.8 * 24 * 1024 <= size_kib <= 24 * 1024  # the guest's disk (less an ext4's own tables)
            smol_vm.write_file("/f", "x" * 2000)
            with pytest.raises(OSError) as caught:
                smol_vm.read_file("/f")
            assert caught.value.errno == errno.EFBIG
            assert smol_vm.exec("head -c 1000 /f").truncated == ("stdout",)
    """)
    pytester.runpytest_subprocess("--smol-backend=namespace").assert_outcomes(passed=1)
