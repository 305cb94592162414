"""Image references as Docker reads them: ``name[:tag]``, ``host[:port]/name:tag``, ``name@sha256:...``."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from pytest_smolvm.errors import UsageError

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
DOCKER_HUB_AUTH_KEY = "https://index.docker.io/v1/"  # the key 'docker login' writes for Docker Hub
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class ImageRef:
    reference: str  # as the user wrote it
    registry: str  # host[:port] as written, "docker.io" for Docker Hub
    repository: str  # "library/alpine"
    tag: str | None  # None when pinned by digest alone
    digest: str | None

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def scheme(self) -> str:
        """Plain HTTP for a registry on loopback (as Docker allows); TLS everywhere else."""
        return "http" if is_loopback(self.registry) else "https"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.api_host}/v2/{self.repository}"

    @property
    def canonical(self) -> str:
        """``registry/repository:tag`` with Docker's defaults filled in (the tag-memo key)."""
        name = f"{self.registry}/{self.repository}"
        return f"{name}@{self.digest}" if self.digest else f"{name}:{self.tag}"

    def with_digest(self, digest: str) -> str:
        return f"{self.registry}/{self.repository}@{digest}"


def is_loopback(host_port: str) -> bool:
    host = host_port
    if host.startswith("["):
        host = host[1:host.find("]")]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse(reference: str, option: str = "--smol-baseline") -> ImageRef:
    """Docker's normalisation: Docker Hub and ``library/`` for bare names, ``latest`` for no tag."""
    def bad(why: str) -> UsageError:
        return UsageError(f"{option}={reference}: not an image reference ({why})")

    rest, digest = reference, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise bad("a digest is sha256: and 64 lowercase hex digits")
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry, path = first, remainder
    else:
        registry, path = DOCKER_HUB, rest
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise bad(f"bad tag {tag!r}")
    if not path or not all(_COMPONENT.fullmatch(part) for part in path.split("/")):
        raise bad("names are lowercase letters, digits and . _ - separated by /")
    if registry in (DOCKER_HUB, "index.docker.io", DOCKER_HUB_API):
        registry = DOCKER_HUB
        if "/" not in path:
            path = f"library/{path}"
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef(reference, registry, path, tag, digest)
