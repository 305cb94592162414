"""A small client for the read side of the OCI distribution API: manifests, blobs and token auth.

Standard library only (urllib): pulling an image is three GETs and an auth challenge, and a user
who only ``pip install``-ed the plugin must be able to pull. Every failure is a one-line
:class:`RegistryError` naming the image.
"""

from __future__ import annotations

import base64
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException, HTTPResponse
from typing import Any

from pytest_smolvm import limits
from pytest_smolvm.baselines.oci import auth
from pytest_smolvm.baselines.oci.reference import ImageRef, is_loopback
from pytest_smolvm.errors import RegistryError

MAX_MANIFEST = 4 << 20  # what the distribution registry itself accepts
MAX_TOKEN = 1 << 20
USER_AGENT = "pytest-smolvm"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
ACCEPT = ", ".join(INDEX_TYPES + MANIFEST_TYPES)
_PARAM = re.compile(r'(\w+)="([^"]*)"')


class Client:
    """One image's repository on one registry; the bearer token is reused for every request."""

    def __init__(self, ref: ImageRef, auth_option: str | None = None, *, option: str = "--smol-baseline") -> None:
        self.ref = ref
        self.option = option  # what the user wrote the reference in, for error messages
        self._auth_option = auth_option
        self._credentials: auth.Credentials | None = None
        self._looked_up = False
        self._authorization: str | None = None
        self.requests: list[str] = []  # paths asked for, for tests and the pull summary

    def error(self, message: str) -> RegistryError:
        return RegistryError(f"{self.option}={self.ref.reference}: {message}")

    # ------------------------------------------------------------------ requests

    def manifest(self, reference: str) -> tuple[bytes, str]:
        """The manifest (or index) ``reference`` names: its bytes and media type."""
        with self._get(f"{self.ref.base_url}/manifests/{reference}", ACCEPT, what=f"manifest {reference}") as r:
            try:
                body = r.read(MAX_MANIFEST + 1)
            except (OSError, HTTPException) as exc:
                raise self.error(f"reading manifest {reference} from {self.ref.registry} broke off: {exc!r}") from None
            media_type = r.headers.get("Content-Type", "").split(";")[0].strip()
        if len(body) > MAX_MANIFEST:
            raise self.error(f"manifest {reference} is larger than {MAX_MANIFEST} bytes")
        return body, media_type

    def blob(self, digest: str) -> HTTPResponse:
        """An open response streaming the blob (the caller verifies its digest)."""
        return self._get(f"{self.ref.base_url}/blobs/{digest}", "*/*", what=f"blob {digest[:19]}")

    def _get(self, url: str, accept: str, *, what: str) -> HTTPResponse:
        self.requests.append(urllib.parse.urlsplit(url).path)
        for attempt in range(2):
            request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": USER_AGENT})
            if self._authorization:
                # Unredirected: a blob redirect to a CDN must not carry the registry's credentials.
                request.add_unredirected_header("Authorization", self._authorization)
            try:
                response: HTTPResponse = urllib.request.urlopen(request, timeout=limits.LIMITS.registry_idle)
                return response
            except urllib.error.HTTPError as exc:
                challenge = exc.headers.get("WWW-Authenticate", "")
                exc.close()
                if exc.code == 401 and attempt == 0 and challenge:
                    self._authorization = self._answer(challenge)
                    continue
                raise self._http_error(exc.code, what) from None
            except (urllib.error.URLError, OSError, HTTPException) as exc:
                reason = getattr(exc, "reason", exc)
                raise self.error(f"cannot reach registry {self.ref.registry} ({self.ref.scheme}): {reason}. "
                                 f"Without a network: 'pytest-smolvm pull {self.ref.reference}' where there is one "
                                 "fills the cache, and --smol-offline then uses what is cached; or pass a "
                                 "docker-save archive or rootfs tarball as the baseline") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _http_error(self, code: int, what: str) -> RegistryError:
        registry = self.ref.registry
        if code in (401, 403):
            how = ("the credentials given were refused" if self._creds() else "no credentials found for it")
            return self.error(f"registry {registry} refused access (HTTP {code}; {how}): 'docker login {registry}', "
                              f"or pass --smol-registry-auth=USER:PASSWORD or ${auth.AUTH_ENV}")
        if code == 404:
            if what.startswith("manifest"):
                return self.error(f"no such image on {registry} (HTTP 404 for {self.ref.repository} "
                                  f"{what.split(' ', 1)[1]}): check the name and tag")
            return self.error(f"registry {registry} has no {what} (HTTP 404)")
        return self.error(f"registry {registry} answered HTTP {code} for {what}")

    # ------------------------------------------------------------------ auth

    def _creds(self) -> auth.Credentials | None:
        if not self._looked_up:
            self._credentials = auth.lookup(self.ref.registry, self._auth_option)
            self._looked_up = True
        return self._credentials

    def _answer(self, challenge: str) -> str:
        scheme, _, rest = challenge.partition(" ")
        params = dict(_PARAM.findall(rest))
        creds = self._creds()
        if scheme.lower() == "basic":
            if creds is None or not creds.username:
                raise self._http_error(401, "")
            return "Basic " + base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
        if scheme.lower() != "bearer" or "realm" not in params:
            raise self.error(f"registry {self.ref.registry} asks for unsupported auth {scheme!r}")
        return "Bearer " + self._token(params, creds)

    def _token(self, params: dict[str, str], creds: auth.Credentials | None) -> str:
        realm = params["realm"]
        parts = urllib.parse.urlsplit(realm)
        if parts.scheme not in ("http", "https"):
            raise self.error(f"registry {self.ref.registry} names a token service {realm!r} that is not http(s)")
        if parts.scheme == "http" and not is_loopback(parts.netloc):
            creds = None  # never send a password in the clear to a token service off this host
        query = {"scope": params.get("scope") or f"repository:{self.ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        headers = {"User-Agent": USER_AGENT}
        data = None
        if creds is not None and creds.identity_token:
            data = urllib.parse.urlencode({**query, "grant_type": "refresh_token", "client_id": USER_AGENT,
                                           "refresh_token": creds.identity_token}).encode()
            url = realm
        else:
            url = realm + ("&" if parts.query else "?") + urllib.parse.urlencode(query)
            if creds is not None and creds.username:
                basic = base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
                headers["Authorization"] = f"Basic {basic}"
        self.requests.append(parts.path)
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers),
                                        timeout=limits.LIMITS.registry_idle) as response:
                body: Any = json.loads(response.read(MAX_TOKEN))
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code in (401, 403):
                raise self._http_error(exc.code, "a token") from None
            raise self.error(f"token service {parts.netloc} for {self.ref.registry} answered HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise self.error(f"token service {parts.netloc} for {self.ref.registry} failed: "
                             f"{getattr(exc, 'reason', exc)}") from None
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise self.error(f"token service {parts.netloc} for {self.ref.registry} returned no token")
        return token
