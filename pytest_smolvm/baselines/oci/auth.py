"""Registry credentials: ``--smol-registry-auth`` / ``PYTEST_SMOLVM_REGISTRY_AUTH`` first, then
``~/.docker/config.json`` (``auths``, ``credHelpers``, ``credsStore``) as ``docker login`` left it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_smolvm import limits
from pytest_smolvm.baselines.oci.reference import DOCKER_HUB, DOCKER_HUB_AUTH_KEY
from pytest_smolvm.errors import UsageError

AUTH_ENV = "PYTEST_SMOLVM_REGISTRY_AUTH"
_HOST = re.compile(r"(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
                   r"|[A-Za-z0-9-]+:[0-9]+")


@dataclass(frozen=True)
class Credentials:
    username: str = ""
    password: str = ""
    identity_token: str = ""  # an OAuth2 refresh token ('docker login' with some registries)


def parse_auth_option(value: str, option: str = "--smol-registry-auth") -> tuple[str | None, Credentials]:
    """``[REGISTRY=]USER:PASSWORD``; without REGISTRY the credentials go to every image's registry."""
    registry, eq, rest = value.partition("=")
    if not (eq and _HOST.fullmatch(registry) and ":" in rest):
        registry, rest = "", value  # no registry part: the '=' (if any) belongs to the password
    user, colon, password = rest.partition(":")
    if not colon or not user:
        raise UsageError(f"{option}: expected [REGISTRY=]USER:PASSWORD")
    return (registry or None), Credentials(user, password)


def _docker_config() -> dict[str, Any]:
    directory = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    try:
        data = json.loads(Path(directory, "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _host_of(key: str) -> str:
    key = key.split("://", 1)[-1]
    return key.split("/", 1)[0]


def _from_helper(helper: str, server: str, registry: str) -> Credentials | None:
    program = f"docker-credential-{helper}"
    if shutil.which(program) is None:
        raise UsageError(f"registry {registry}: ~/.docker/config.json names the credential helper {program}, "
                         "which is not installed (install it, or pass --smol-registry-auth)")
    try:
        done = subprocess.run([program, "get"], input=server, capture_output=True, text=True,
                              timeout=limits.LIMITS.credential_helper)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"registry {registry}: credential helper {program} failed: {exc}") from None
    if done.returncode != 0:
        return None  # "credentials not found": anonymous access may still work
    try:
        found = json.loads(done.stdout)
    except ValueError:
        return None
    user, secret = str(found.get("Username", "")), str(found.get("Secret", ""))
    if user == "<token>":
        return Credentials(identity_token=secret)
    return Credentials(user, secret) if user else None


def lookup(registry: str, option_value: str | None) -> Credentials | None:
    """Credentials for ``registry`` (host[:port], "docker.io" for Docker Hub), or None for anonymous."""
    for value, option in ((option_value, "--smol-registry-auth"), (os.environ.get(AUTH_ENV), AUTH_ENV)):
        if value:
            scope, creds = parse_auth_option(value, option)
            if scope is None or _host_of(scope) == registry or (registry == DOCKER_HUB and "docker.io" in scope):
                return creds
    config = _docker_config()
    server = DOCKER_HUB_AUTH_KEY if registry == DOCKER_HUB else registry
    helpers = config.get("credHelpers") or {}
    if isinstance(helpers, dict) and isinstance(helpers.get(server), str):
        return _from_helper(helpers[server], server, registry)
    auths = config.get("auths") or {}
    entry: dict[str, Any] | None = None
    if isinstance(auths, dict):
        for key, value in auths.items():
            if isinstance(value, dict) and (key == server or _host_of(key) == registry
                                            or (registry == DOCKER_HUB and _host_of(key) == "index.docker.io")):
                entry = value
                break
    if entry:
        if entry.get("identitytoken"):
            return Credentials(identity_token=str(entry["identitytoken"]))
        if entry.get("auth"):
            try:
                user, _, password = base64.b64decode(str(entry["auth"])).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise UsageError(f"registry {registry}: the 'auth' entry in ~/.docker/config.json "
                                 "is not base64 of USER:PASSWORD") from None
            return Credentials(user, password)
        if entry.get("username"):
            return Credentials(str(entry["username"]), str(entry.get("password", "")))
    store = config.get("credsStore")
    if isinstance(store, str) and store:
        return _from_helper(store, server, registry)
    return None
