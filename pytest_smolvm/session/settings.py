"""Options, ini keys and the ``smol`` marker: parsed once, validated with one-line errors.

Precedence for every setting: marker > command line > ini > default. This module validates
(and puts the command line over ini); ``spec.py`` puts a test's keywords over these and the
default limits, once per guest, into the spec its backend gets.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm.errors import MarkerError, UsageError
from pytest_smolvm.limits import guest_env, guest_timeout, guest_user

BACKEND_CHOICES = ("auto", "smol", "namespace")
TARGET_CHOICES = ("local", "cloud")
KEEP_CHOICES = ("never", "failed", "always")
LOGS_CHOICES = ("failed", "always")
MARKER_KEYWORDS = ("image", "cpus", "memory_mb", "network", "allow_hosts", "timeout", "env", "user", "output_limit",
                   "relax", "branchable")
SIZE_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
# Parts of a namespace guest's confinement a marker may turn off (docs/security.md):
# "seccomp": no syscall filter; "limits": no default memory/CPU limits (the pids limit stays).
RELAX_CHOICES = ("seccomp", "limits")
# The smallest limits a test may name, the same on every backend. CPUs: the kernel's smallest CPU
# quota is 1 ms a period, and a namespace guest's period is 100 ms (a smaller cpus was EINVAL
# from the cgroup, reported as a bare OSError). Memory: a guest's own setup needs a few MiB (a
# namespace guest's setup was OOM-killed at 2 MiB, reported as "died without a word").
MIN_CPUS = 0.01
MAX_CPUS = 8192  # the kernel's largest NR_CPUS; past ~1.7e8 a CPU quota is EINVAL at guest setup
MIN_MEMORY_MB = 16

# A DNS name as a resolver takes it: dot-separated labels of 1-63 letters, digits, '-' or '_'
# (not at a label's ends), 253 characters in all, an optional final dot.
_HOST_NAME = re.compile(r"(?=.{1,253}\.?\Z)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                        r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?\Z")


def _allowed_host(where: str, entry: str) -> None:
    """An ``allow_hosts`` entry is a network, an address or a host name: checked here, when the
    marker is read, rather than found to be none of them by a DNS lookup when the guest is made."""
    if "/" in entry:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError as exc:
            raise UsageError(f"{where}(allow_hosts=...): {exc}") from None
        return
    try:
        ipaddress.ip_address(entry)
    except ValueError:
        if not _HOST_NAME.match(entry):
            raise UsageError(f"{where}(allow_hosts=...): {entry!r} is not a host name, an IP address or a CIDR "
                             "network") from None

# (option, ini key, help); defaults live in Settings so that "not given" stays visible.
OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("--smol-baseline", "smol_baseline",
     "baseline every guest forks from: rootfs dir, rootfs tarball (.tar/.tar.gz/.tar.zst), "
     "docker-save/OCI archive, .smolmachine (smol) or registry image (name:tag, host/name:tag, "
     "name@sha256:...). Default: the bundled Alpine rootfs."),
    ("--smol-backend", "smol_backend",
     "auto (microVM if one boots here, else namespace), smol or namespace. Default: auto."),
    ("--smol-target", "smol_target", "where smol microVMs run: local or cloud. Default: local."),
    ("--smol-keep", "smol_keep",
     "keep guests after their test: never, failed or always. Default: never."),
    ("--smol-max-vms", "smol_max_vms", "most guests alive at once on this host, all workers together."),
    ("--smol-concurrency", "smol_concurrency",
     "async def guest tests each worker runs at once, each its own test (smol_episodes(concurrency=N) "
     "per test). Default: 1."),
    ("--smol-results", "smol_results", "write one JSON line per test/episode to this file."),
    ("--smol-artifacts", "smol_artifacts", "save guest logs and transcripts under this dir, one dir per test."),
    ("--smol-logs", "smol_logs",
     "which tests' guest logs and transcripts go to every report sink: failed or always. Default: failed."),
    ("--smol-user", "smol_user",
     "guest user (name or uid in the guest's /etc/passwd) every exec and file operation runs as. "
     "Default: root."),
    ("--smol-output-limit", "smol_output_limit",
     "bytes of each exec's stdout and stderr kept (head and tail; suffix k, m or g). Default: 16m."),
)


REGISTRY_AUTH_HELP = ("[REGISTRY=]USER:PASSWORD for pulling registry images (or set $PYTEST_SMOLVM_REGISTRY_AUTH, "
                      "which keeps it out of ps); else ~/.docker/config.json is read.")
OFFLINE_HELP = "pull nothing: registry images come from the host's cache only (pre-pull: pytest-smolvm pull IMAGE)."


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("smolvm", "pytest-smolvm: a fresh guest per test")
    for option, ini, help_text in OPTIONS:
        group.addoption(option, dest=ini, default=None, metavar=ini.upper().removeprefix("SMOL_"),
                        help=help_text)
        parser.addini(ini, help=help_text, default=None)
    # Credentials get no ini key: an ini file is committed.
    group.addoption("--smol-registry-auth", dest="smol_registry_auth", default=None, metavar="AUTH",
                    help=REGISTRY_AUTH_HELP)
    group.addoption("--smol-offline", dest="smol_offline", action="store_true", default=None, help=OFFLINE_HELP)
    parser.addini("smol_offline", help=OFFLINE_HELP, type="bool", default=False)


@dataclass(frozen=True)
class Settings:
    baseline: str | None = None
    backend: str = "auto"
    target: str = "local"
    keep: str = "never"
    max_vms: int | None = None
    concurrency: int = 1  # async guest tests in flight at once per pytest process (plugin/concurrency.py)
    results: Path | None = None
    artifacts: Path | None = None
    logs: str = "failed"
    user: str | None = None
    output_limit: int | None = None  # None: LIMITS.output_bytes, read as each guest is resolved (spec.py)
    rootdir: Path = field(default_factory=Path.cwd)
    baseline_option: str = "--smol-baseline"  # or the ini key, so errors name what the user wrote
    registry_auth: str | None = None  # --smol-registry-auth; the env var is read where it is used
    offline: bool = False

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        """Read CLI over ini; raise UsageError naming the option for any bad value."""
        for variable in ("PYTEST_SMOLVM_CACHE_DIR", "PYTEST_SMOLVM_STATE_DIR"):  # read where first used
            if os.environ.get(variable):
                _can_be_a_directory(f"${variable}", Path(os.environ[variable]).absolute())
        values: dict[str, tuple[str, str | None, Path]] = {}
        for option, ini, _ in OPTIONS:
            cli_value = config.getoption(ini)
            if cli_value is not None:
                values[ini] = (option, str(cli_value), config.invocation_params.dir)
                continue
            ini_value = config.getini(ini)
            if ini_value not in (None, ""):
                values[ini] = (ini, str(ini_value), config.rootpath)

        def get(key: str) -> tuple[str, str | None, Path]:
            return values.get(key, (key, None, config.rootpath))

        settings = cls(rootdir=config.rootpath)
        changes: dict[str, Any] = {}
        name, value, _ = get("smol_backend")
        if value is not None:
            settings = replace(settings, backend=_known_backend(name, value))
        for key, choices, attr in (("smol_target", TARGET_CHOICES, "target"),
                                   ("smol_keep", KEEP_CHOICES, "keep"),
                                   ("smol_logs", LOGS_CHOICES, "logs")):
            name, value, _ = get(key)
            if value is not None:
                if value not in choices:
                    raise UsageError(f"{name}={value}: choose one of {', '.join(choices)}")
                changes[attr] = value
        name, value, _ = get("smol_max_vms")
        if value is not None:
            settings = replace(settings, max_vms=_positive_int(name, value))
        name, value, _ = get("smol_concurrency")
        if value is not None:
            changes["concurrency"] = _positive_int(name, value)
        name, value, _ = get("smol_user")
        if value is not None:
            changes["user"] = guest_user(name, value, UsageError)
        name, value, _ = get("smol_output_limit")
        if value is not None:
            changes["output_limit"] = byte_size(name, value)
        name, value, base = get("smol_baseline")
        if value is not None:
            from pytest_smolvm.baselines.baseline import check_reference

            check_reference(value, base, option=name)  # a typo fails now; digesting waits for a guest
            settings = replace(settings, baseline=value, rootdir=base, baseline_option=name)
        for key, attr in (("smol_results", "results"), ("smol_artifacts", "artifacts")):
            name, value, base = get(key)
            if value is not None:
                if not value.strip():
                    raise UsageError(f"{name}: expected a path, got an empty value")
                changes[attr] = base / Path(value).expanduser()
                if attr == "artifacts":
                    _can_be_a_directory(name, changes[attr])
        auth_value = config.getoption("smol_registry_auth", None)
        if auth_value is not None or os.environ.get("PYTEST_SMOLVM_REGISTRY_AUTH"):
            from pytest_smolvm.baselines.oci.auth import AUTH_ENV, parse_auth_option

            # a malformed value fails here, naming the option (or the variable), never quoting it
            if auth_value is not None:
                parse_auth_option(str(auth_value))
                changes["registry_auth"] = str(auth_value)
            else:
                parse_auth_option(os.environ[AUTH_ENV], f"${AUTH_ENV}")
        offline = config.getoption("smol_offline", None)
        if offline is None:
            try:
                offline = config.getini("smol_offline")
            except ValueError as exc:  # pytest's own parse of a bool ini value
                raise UsageError(f"smol_offline: {exc} (expected true or false)") from None
        changes["offline"] = bool(offline)
        return replace(settings, **changes)

    @classmethod
    def from_keywords(cls, where: str, *, baseline: str | None = None, backend: str = "auto",
                      target: str = "local", keep: str = "never", max_vms: int | None = None,
                      user: str | int | None = None, output_limit: int | str | None = None,
                      registry_auth: str | None = None, offline: bool = False,
                      rootdir: str | Path | None = None) -> Settings:
        """The same settings from keyword arguments (the library's Session); errors name ``where(key=...)``."""
        root = Path(rootdir).expanduser() if rootdir is not None else Path.cwd()
        backend = _known_backend(f"{where}(backend)", backend)
        for key, value, choices in (("target", target, TARGET_CHOICES), ("keep", keep, KEEP_CHOICES)):
            if value not in choices:
                raise UsageError(f"{where}({key}={value!r}): choose one of {', '.join(choices)}")
        settings = cls(backend=backend, target=target, keep=keep, rootdir=root, offline=bool(offline),
                       baseline_option=f"{where}(baseline)")
        changes: dict[str, Any] = {}
        if max_vms is not None:
            changes["max_vms"] = _positive_int(f"{where}(max_vms)", max_vms)
        if user is not None:
            changes["user"] = guest_user(f"{where}(user)", user, UsageError)
        if output_limit is not None:
            changes["output_limit"] = byte_size(f"{where}(output_limit)", output_limit)
        if baseline is not None:
            from pytest_smolvm.baselines.baseline import check_reference

            check_reference(baseline, root, option=f"{where}(baseline)")
            changes["baseline"] = baseline
        if registry_auth is not None:
            from pytest_smolvm.baselines.oci.auth import parse_auth_option

            parse_auth_option(registry_auth, f"{where}(registry_auth)")
            changes["registry_auth"] = registry_auth
        return replace(settings, **changes)


def _known_backend(name: str, value: str) -> str:
    if value in BACKEND_CHOICES:
        return value
    from pytest_smolvm.backends import backend_class

    try:
        backend_class(value)
    except UsageError:
        raise UsageError(f"{name}={value}: unknown backend (choose auto, smol, namespace or an "
                         "installed pytest_smolvm.backends entry point)") from None
    return value


def _can_be_a_directory(name: str, path: Path) -> None:
    """``path`` is a directory, or one this user can make: checked at startup, without making
    it (the first test that saves files does), so a typo fails the run, not every test."""
    there = path
    while not os.path.lexists(there) and there.parent != there:
        there = there.parent
    if not there.is_dir():
        raise UsageError(f"{name}={path}: {'it' if there == path else there} is not a directory")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(f"{name}={path}: {there} is not writable")


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name}={value}: expected a positive integer") from None
    if number <= 0 or isinstance(value, bool):
        raise UsageError(f"{name}={value}: expected a positive integer")
    return number


def byte_size(name: str, value: Any) -> int:
    """A positive byte count: an int, or a string like ``4096``, ``64k``, ``16m``, ``1g``."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        text = value.strip().lower().removesuffix("b").removesuffix("i")
        digits, suffix = (text[:-1], text[-1]) if text and text[-1] in SIZE_SUFFIXES else (text, "")
        if not digits.isdigit():
            raise UsageError(f"{name}={value}: expected a byte count like 1048576, 64k or 16m")
        number = int(digits) * SIZE_SUFFIXES[suffix]
    else:
        raise UsageError(f"{name}={value!r}: expected a byte count like 1048576, 64k or 16m")
    if number <= 0:
        raise UsageError(f"{name}={value}: expected a positive byte count")
    return number


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{name}={value!r}: expected a positive number")
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{name}={value!r}: expected a positive number")
    return float(value)


@dataclass(frozen=True)
class MarkerSpec:
    """The ``smol`` marker's keywords for one test, closest marker winning per keyword."""

    image: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    network: bool = False
    allow_hosts: tuple[str, ...] = ()
    timeout: float | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    user: str | int | None = None  # None: --smol-user, else root
    output_limit: int | None = None  # None: --smol-output-limit, else 16 MiB
    relax: tuple[str, ...] = ()
    branchable: bool = False  # smol: start the guest so that vm.branch() can branch it (namespace: always)

    def merged(self, overrides: Mapping[str, Any], where: str) -> MarkerSpec:
        """This spec with ``overrides`` (marker or factory keywords) applied and validated.

        A bad keyword raises MarkerError: it is the test's own, so only that test errors.
        """
        try:
            changes = self._changes(overrides, where)
        except UsageError as exc:
            raise MarkerError(str(exc)) from None
        return replace(self, **changes)

    def _changes(self, overrides: Mapping[str, Any], where: str) -> dict[str, Any]:
        unknown = sorted(set(overrides) - set(MARKER_KEYWORDS))
        if unknown:
            raise UsageError(f"{where}: unknown keyword {unknown[0]!r} "
                             f"(expected one of {', '.join(MARKER_KEYWORDS)})")
        changes: dict[str, Any] = {}
        for key, value in overrides.items():
            label = f"{where}({key}=...)"
            if value is None and key in ("image", "cpus", "memory_mb", "timeout", "user", "output_limit"):
                changes[key] = None
            elif key == "image":
                if not isinstance(value, str) or not value:
                    raise UsageError(f"{label}: image must be a non-empty string")
                changes[key] = value
            elif key == "cpus":
                changes[key] = _positive_number(f"{where}(cpus)", value)
                if changes[key] < MIN_CPUS:
                    raise UsageError(f"{where}(cpus={value!r}): expected at least {MIN_CPUS} (the smallest CPU quota)")
                if changes[key] > MAX_CPUS:
                    raise UsageError(f"{where}(cpus={value!r}): expected at most {MAX_CPUS}")
            elif key == "memory_mb":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise UsageError(f"{where}(memory_mb={value!r}): expected a positive integer")
                changes[key] = _positive_int(f"{where}(memory_mb)", value)
                if value < MIN_MEMORY_MB:
                    raise UsageError(f"{where}(memory_mb={value!r}): expected at least {MIN_MEMORY_MB} (MiB: a guest's "
                                     "own setup needs a few)")
            elif key == "timeout":
                changes[key] = guest_timeout(f"{where}(timeout)", value, UsageError)
            elif key == "user":
                changes[key] = guest_user(f"{where}(user)", value, UsageError)
            elif key == "output_limit":
                changes[key] = byte_size(f"{where}(output_limit)", value)
            elif key in ("network", "branchable"):
                if not isinstance(value, bool):
                    raise UsageError(f"{where}({key}={value!r}): expected True or False")
                changes[key] = value
            elif key == "allow_hosts":
                if isinstance(value, str) or not all(isinstance(h, str) and h for h in value):
                    raise UsageError(f"{where}(allow_hosts={value!r}): expected a list of host names")
                for entry in value:
                    _allowed_host(where, entry)
                changes[key] = tuple(value)
            elif key == "relax":
                if isinstance(value, str) or not all(isinstance(p, str) for p in value):
                    raise UsageError(f"{where}(relax={value!r}): expected a list of {', '.join(RELAX_CHOICES)}")
                unknown_parts = sorted(set(value) - set(RELAX_CHOICES))
                if unknown_parts:
                    raise UsageError(f"{where}(relax=...): unknown part {unknown_parts[0]!r} "
                                     f"(choose from {', '.join(RELAX_CHOICES)})")
                changes[key] = tuple(value)
            elif key == "env":
                changes[key] = {**self.env, **guest_env(f"{where}(env)", value, UsageError)}
        return changes


def marker_spec(item: pytest.Item) -> MarkerSpec:
    """The ``smol`` markers on ``item`` (module, class, function), the closest winning."""
    spec = MarkerSpec()
    for mark in reversed(list(item.iter_markers("smol"))):  # farthest first, closest last
        if mark.args:
            raise UsageError(f"@pytest.mark.smol takes keywords only, got positional {mark.args!r}")
        spec = spec.merged(mark.kwargs, "@pytest.mark.smol")
    return spec


MARKERS = (
    "smol(image=None, cpus=None, memory_mb=None, network=False, allow_hosts=[], timeout=None, env={}, "
    "user=None, output_limit=None, relax=[], branchable=False): guest settings for this test's smol_vm; "
    "relax turns off parts of a namespace guest's confinement: seccomp, limits; branchable starts a smol "
    "guest so that vm.branch() can branch it (pytest-smolvm)",
    "smol_episodes(n, seed=0, concurrency=1): run this test as n episodes (ids ep0..ep{n-1}), each with a "
    "fresh guest and a deterministic seed, up to `concurrency` at once (async def tests); the smol_episode "
    "fixture records rewards (pytest-smolvm)",
)
