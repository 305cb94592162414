"""A real OCI registry on 127.0.0.1 for the tests: the CNCF distribution registry (Debian's
``docker-registry``), images pushed to it through the distribution HTTP API, and a small proxy in
front of it that can ask for bearer tokens, corrupt blobs or slow them down.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.server
import io
import json
import re
import socket
import subprocess
import tarfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from pytest_smolvm.baselines.baseline import bundled_rootfs_tarball
from tests import tools

REGISTRY_BINARY = "docker-registry"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
_ACCESS = re.compile(r'"(GET|HEAD|POST|PUT|PATCH) (\S+) HTTP/[0-9.]+" (\d+)')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def digest_of(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass
class Registry:
    host: str  # 127.0.0.1:PORT
    log: Path
    process: subprocess.Popen[bytes]
    credentials: tuple[str, str] | None = None

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request the registry served, from its access log."""
        return [(m, p, int(s)) for m, p, s in _ACCESS.findall(self.log.read_text(errors="replace"))]

    def blob_gets(self) -> list[str]:
        return [p for m, p, _ in self.requests() if m == "GET" and "/blobs/" in p]

    def _call(self, method: str, url: str, data: bytes | None = None,
              headers: dict[str, str] | None = None) -> Any:
        request = urllib.request.Request(url if url.startswith("http") else f"http://{self.host}{url}",
                                         data=data, method=method, headers=headers or {})
        if self.credentials:
            token = base64.b64encode(":".join(self.credentials).encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        return urllib.request.urlopen(request, timeout=30)

    def push_blob(self, repo: str, data: bytes) -> str:
        digest = digest_of(data)
        with self._call("POST", f"/v2/{repo}/blobs/uploads/") as started:
            location = started.headers["Location"]
        sep = "&" if "?" in location else "?"
        url = location if location.startswith("http") else f"http://{self.host}{location}"
        with self._call("PUT", f"{url}{sep}digest={digest}", data,
                        {"Content-Type": "application/octet-stream"}):
            pass
        return digest

    def push_manifest(self, repo: str, ref: str, manifest: dict[str, Any]) -> str:
        body = json.dumps(manifest).encode()
        with self._call("PUT", f"/v2/{repo}/manifests/{ref}", body, {"Content-Type": manifest["mediaType"]}):
            pass
        return digest_of(body)

    def push_image(self, repo: str, tag: str, layers: list[bytes], config: dict[str, Any],
                   arch: str = "amd64") -> str:
        """A one-platform OCI image; returns its manifest digest."""
        image_config = {"architecture": arch, "os": "linux", "config": config,
                        "rootfs": {"type": "layers", "diff_ids": [digest_of(gzip.decompress(x)) for x in layers]}}
        config_bytes = json.dumps(image_config).encode()
        manifest = {
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": self.push_blob(repo, config_bytes),
                       "size": len(config_bytes)},
            "layers": [{"mediaType": LAYER_GZIP, "digest": self.push_blob(repo, layer), "size": len(layer)}
                       for layer in layers],
        }
        return self.push_manifest(repo, tag, manifest)


def start_registry(workdir: Path, *, htpasswd: Path | None = None) -> Registry:
    """Start ``docker-registry serve`` on a free loopback port; stop it with :func:`stop_registry`."""
    binary = tools.require(REGISTRY_BINARY, "the CNCF distribution registry the OCI tests pull from")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    auth = (f"auth:\n  htpasswd:\n    realm: test\n    path: {htpasswd}\n" if htpasswd else "")
    config = workdir / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: false\n"
                      f"storage:\n  filesystem:\n    rootdirectory: {workdir / 'data'}\n"
                      f"http:\n  addr: 127.0.0.1:{port}\n{auth}")
    log = workdir / "registry.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT)
    registry = Registry(f"127.0.0.1:{port}", log, process)
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://{registry.host}/v2/", timeout=2):
                break
        except urllib.error.HTTPError:
            break  # 401 from an auth-protected registry: it is up
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop_registry(registry)
                raise RuntimeError(f"docker-registry did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.1)
    return registry


def stop_registry(registry: Registry) -> None:
    registry.process.terminate()
    try:
        registry.process.wait(10)
    except subprocess.TimeoutExpired:
        registry.process.kill()
        registry.process.wait(10)


# --------------------------------------------------------------------------- layers


def tar_layer(entries: list[tuple[str, bytes | None]]) -> bytes:
    """A gzip tar layer; an entry with None content is a directory."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(content), 0o644
                tar.addfile(info, io.BytesIO(content))
    return gzip.compress(raw.getvalue(), mtime=0)


def alpine_layer() -> bytes:
    """The bundled Alpine rootfs as one gzip layer, owned by root as a real image's files are."""
    out = io.BytesIO()
    with open(bundled_rootfs_tarball(), "rb") as f, \
            zstandard.ZstdDecompressor().stream_reader(f) as stream, \
            tarfile.open(fileobj=stream, mode="r|") as src, \
            gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=1) as gz, \
            tarfile.open(fileobj=gz, mode="w") as dst:
        for member in src:
            member.uid = member.gid = 0
            member.uname = member.gname = "root"
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return out.getvalue()


# --------------------------------------------------------------------------- a proxy in front


@dataclass
class ProxyConfig:
    upstream: str
    bearer: bool = False  # ask for an anonymous bearer token, as Docker Hub does
    corrupt_blobs: set[str] = field(default_factory=set)  # digests whose bytes get flipped
    delay_per_mb: float = 0.0  # seconds per MiB of blob, to make a pull slow enough to show progress
    blob_delay: float = 0.0  # seconds before any blob GET is answered (a registry slow to first byte)
    token_user: tuple[str, str] | None = None  # the token service wants this password (or the refresh token)
    refresh_token: str = "refresh-me"
    tokens_issued: int = 0
    paths: list[str] = field(default_factory=list)
    # Faults mid-pull: the next blob GETs answer these statuses, in order, before any passes through;
    blob_statuses: list[int] = field(default_factory=list)
    # the next ``blob_drops`` blob GETs send their headers and ``drop_after`` bytes, then hang up;
    blob_drops: int = 0
    drop_after: int = 1 << 16
    # and a blob body is sent 64 KiB at a time with this many seconds between (a pull to kill).
    chunk_delay: float = 0.0


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    config: ProxyConfig
    token = "test-token-123"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        config = self.config
        config.paths.append(self.path)
        if self.path.startswith("/token"):
            basic = "Basic " + base64.b64encode(":".join(config.token_user).encode()).decode() \
                if config.token_user else None
            if basic and self.headers.get("Authorization") != basic:
                self._reply(401, b"{}", {})
                return
            config.tokens_issued += 1
            self._reply(200, json.dumps({"token": self.token}).encode(), {"Content-Type": "application/json"})
            return
        if config.bearer and self.headers.get("Authorization") != f"Bearer {self.token}":
            host = self.headers.get("Host")
            challenge = f'Bearer realm="http://{host}/token",service="test-registry"'
            self._reply(401, b"{}", {"WWW-Authenticate": challenge})
            return
        request = urllib.request.Request(f"http://{config.upstream}{self.path}",
                                         headers={"Accept": self.headers.get("Accept", "*/*")})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                body, status, headers = response.read(), response.status, dict(response.headers)
        except urllib.error.HTTPError as exc:
            body, status, headers = exc.read(), exc.code, dict(exc.headers)
        digest = self.path.rsplit("/", 1)[-1]
        blob = "/blobs/" in self.path
        if blob and digest in config.corrupt_blobs and body:
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        if blob and (config.delay_per_mb or config.blob_delay):
            time.sleep(config.blob_delay + config.delay_per_mb * len(body) / (1 << 20))
        keep = {k: v for k, v in headers.items() if k.lower() in ("content-type", "docker-content-digest")}
        if blob and config.blob_statuses:
            self._reply(config.blob_statuses.pop(0), b'{"errors": []}', {"Content-Type": "application/json"})
            return
        if blob and config.blob_drops:
            config.blob_drops -= 1
            self._reply(status, body, keep, stop_after=config.drop_after)
            return
        self._reply(status, body, keep, chunk_delay=config.chunk_delay if blob else 0.0)

    def do_POST(self) -> None:
        """The OAuth2 side of the token service: a refresh token ('identitytoken') for an access token."""
        length = int(self.headers.get("Content-Length", "0"))
        form = urllib.parse.parse_qs(self.rfile.read(length).decode())
        self.config.paths.append(f"POST {self.path}")
        if form.get("grant_type") != ["refresh_token"] or form.get("refresh_token") != [self.config.refresh_token]:
            self._reply(401, b"{}", {})
            return
        self.config.tokens_issued += 1
        self._reply(200, json.dumps({"access_token": self.token}).encode(), {"Content-Type": "application/json"})

    def _reply(self, status: int, body: bytes, headers: dict[str, str], *, stop_after: int | None = None,
               chunk_delay: float = 0.0) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if stop_after is not None:  # the connection drops mid-body: fewer bytes than promised
            self.wfile.write(body[:stop_after])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        step = 1 << 16 if chunk_delay else max(len(body), 1)
        try:
            for start in range(0, len(body), step):
                self.wfile.write(body[start:start + step])
                if chunk_delay:
                    self.wfile.flush()
                    time.sleep(chunk_delay)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the puller went away (killed mid-pull)


@contextlib.contextmanager
def proxy(config: ProxyConfig) -> Iterator[str]:
    """A proxy in front of ``config.upstream`` on a free loopback port; yields its host:port."""
    handler = type("Handler", (_ProxyHandler,), {"config": config})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
