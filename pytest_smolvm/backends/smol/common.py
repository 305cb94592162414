"""What every smol module shares: names and labels, SDK connections and how SDK errors are read.

Nothing here imports ``smol`` at module level (importing it mutates ``os.environ``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_smolvm.errors import GuestError, GuestUserError, ProvisionError

if TYPE_CHECKING:
    from smol import ConnectOptions, SmolError

TARGETS = ("local", "cloud")
IMAGE_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # what the engine recognises as a local archive
LABEL = "pytest-smolvm"
SOURCE_LABEL = "pytest-smolvm-source"  # children inherit their source's labels: finds them by source
SOURCE_PREFIX = "pytest-smolvm-src-"
DERIVED = " + setup"  # ends a warm baseline's reference; never part of an image reference (no spaces)
GONE_CODES = frozenset({"NOT_FOUND", "VM_NOT_FOUND"})
USER_HINTS = ("user", "passwd", "uid")  # an engine error that mentions these is about the user
TIMEOUT_CODES = frozenset({"TIMEOUT", "CANCELLED", "INTERRUPTED"})
# Worth another provisioning attempt whatever the server's ``retryable`` flag says: the request
# never got an answer (CONNECTION, TIMEOUT), or the machine was cut off under it.
RETRYABLE_CODES = frozenset({"CONNECTION", "NETWORK_ERROR", "TIMEOUT", "MACHINE_INTERRUPTED"})
TIMEOUT_EXIT = 124
KILLED_EXITS = frozenset({TIMEOUT_EXIT, 128 + 9, 128 + 15, -9, -15})
DEFAULT_TTL_SECONDS = 3600



def cloud_token_source() -> str | None:
    """Where a smol cloud API key would come from, without reading it out: env var or CLI config."""
    if os.environ.get("SMOL_CLOUD_TOKEN"):
        return "SMOL_CLOUD_TOKEN"
    homes = [os.path.join(os.path.expanduser("~"), ".config")]
    if os.environ.get("XDG_CONFIG_HOME"):
        homes.insert(0, os.environ["XDG_CONFIG_HOME"])
    for home in homes:
        path = os.path.join(home, "smolvm", "config.toml")
        if _config_has_api_key(path):
            return path
    return None


def _config_has_api_key(path: str) -> bool:
    """Whether ``[cloud] api_key`` is set in the CLI config (a line scan: tomllib is 3.11+)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    in_cloud = False
    for raw in lines:
        line = raw.strip()
        if line.startswith("["):
            in_cloud = line == "[cloud]"
        elif in_cloud and line.startswith("api_key"):
            key, _, value = line.partition("=")
            if key.strip() == "api_key" and value.strip().strip("\"'"):
                return True
    return False


def _smol_version() -> str:
    from pytest_smolvm.backends.smol.probe import smolmachines_version

    return smolmachines_version() or "not installed"


def _connect(target: str) -> ConnectOptions:
    from smol import ConnectOptions

    return ConnectOptions(target="cloud" if target == "cloud" else "local")


def _describe(exc: SmolError) -> str:
    return f"[{exc.code}] {exc.message}"


def _is_gone(exc: SmolError) -> bool:
    return exc.code in GONE_CODES or "not found" in exc.message.lower()


def is_retryable(exc: SmolError) -> bool:
    """Whether a failed provisioning call is worth repeating (with a new name).

    The cloud says so itself: ``SmolError.retryable`` comes from the problem body's
    ``retryable`` or, failing that, from 408/429/502/503/504 (transport.py:2179-2205).
    """
    return bool(getattr(exc, "retryable", False)) or exc.code in RETRYABLE_CODES


def provision_error(message: str, exc: SmolError) -> ProvisionError:
    return ProvisionError(f"{message}: {_describe(exc)}", retryable=is_retryable(exc))


@dataclass(frozen=True)
class OwnedMachine:
    """A machine this plugin made, as ``Machine.list`` reports it (for the reaper)."""

    name: str
    state: str
    labels: Mapping[str, str]
    is_source: bool


def exec_error(exc: SmolError, name: str, user: str | None) -> Exception:
    """The error a failed exec stands for: a user the engine refused is named as such."""
    message = f"[{exc.code}] {exc.message}"
    if user is not None and (exc.code in ("INVALID_CONFIG", "NOT_SUPPORTED") or
                             any(hint in exc.message.lower() for hint in USER_HINTS)):
        return GuestUserError(f"user {user!r} in {name}: {message}")
    return GuestError(f"exec in {name} failed: {message}")
