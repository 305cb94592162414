"""Resolve an image reference to a manifest digest and pull its blobs into the host's cache.

:func:`resolve_image` is the entry point: reference + settings in, a pinned
:class:`~pytest_smolvm.baselines.baseline.Baseline` out, its digest the one the reference names (the index
digest for a multi-platform image, as ``docker pull`` prints) and its path the host platform's
manifest in the blob cache. Unpacking (once per host per manifest) is
:func:`pytest_smolvm.baselines.baseline.unpack`, which calls :func:`unpack_image` here.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from http.client import HTTPException
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from pytest_smolvm.baselines.oci import store
from pytest_smolvm.baselines.oci.client import Client
from pytest_smolvm.baselines.oci.reference import ImageRef, parse
from pytest_smolvm.errors import DigestMismatch, RegistryError
from pytest_smolvm.host.paths import cache_dir
from pytest_smolvm.host.progress import Progress, megabytes

if TYPE_CHECKING:
    from pytest_smolvm.baselines.baseline import Baseline

MAX_CONFIG = 8 << 20
LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
               "application/vnd.oci.image.layer.v1.tar+zstd", "application/vnd.docker.image.rootfs.diff.tar.gzip")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_ARCH = {"x86_64": ("amd64", ""), "amd64": ("amd64", ""), "aarch64": ("arm64", ""), "arm64": ("arm64", ""),
         "armv7l": ("arm", "v7"), "armv6l": ("arm", "v6"), "i386": ("386", ""), "i686": ("386", ""),
         "ppc64le": ("ppc64le", ""), "s390x": ("s390x", ""), "riscv64": ("riscv64", "")}


def host_platform() -> tuple[str, str]:
    """(architecture, variant) in OCI's words for this host."""
    machine = platform.machine().lower()
    return _ARCH.get(machine, (machine, ""))


class PullSettings(Protocol):
    """What a pull needs of the run's settings (``Settings`` has both)."""

    @property
    def registry_auth(self) -> str | None: ...

    @property
    def offline(self) -> bool: ...


def pin_registry_image(found: Baseline, settings: PullSettings, backend: str, *, option: str = "--smol-baseline",
                       run_id: str | None = None) -> Baseline:
    """``found`` (from :func:`pytest_smolvm.baselines.baseline.resolve`), pinned and pulled if it is a registry
    image for a backend that unpacks images on this host: every backend but smol, whose engine
    pulls images itself."""
    if found.kind != "registry" or backend == "smol":
        return found
    return resolve_image(found.reference, settings, run_id=run_id, option=option)


def resolve_image(reference: str, settings: PullSettings, *, run_id: str | None = None,
                  option: str = "--smol-baseline") -> Baseline:
    """Pin ``reference`` to a digest and make sure everything needed to unpack it is cached.

    A digest reference whose blobs are cached needs no network. A tag is looked up once per
    run (``run_id``) and never with ``settings.offline``, which takes the last digest pulled.
    """
    from pytest_smolvm.baselines.baseline import Baseline

    ref = parse(reference, option)
    puller = _Puller(ref, Client(ref, settings.registry_auth, option=option), offline=settings.offline)
    try:
        top = puller.top_digest(run_id)
        manifest_digest = puller.platform_manifest(top)
        puller.ensure_blobs(manifest_digest)
    except RegistryError as exc:
        if not any(c in reference for c in ":@/"):
            # A bare word is a Docker Hub name and a relative path alike: a typo'd path must say so.
            why = str(exc).removeprefix(f"{option}={reference}: ")
            raise RegistryError(f"{option}={reference}: no such file or directory, and as the "
                                f"registry image {ref.canonical}: {why}") from None
        raise
    return Baseline(reference, "registry", store.blob_path(manifest_digest), top)


def unpacked_marker(manifest_digest: str) -> Path:
    """Where :func:`pytest_smolvm.baselines.baseline.unpack` records a finished unpack of this manifest."""
    return cache_dir() / "baselines" / manifest_digest.split(":", 1)[-1][:32] / "image.json"


class _Puller:
    def __init__(self, ref: ImageRef, client: Client, *, offline: bool) -> None:
        self.ref = ref
        self.client = client
        self.offline = offline

    def error(self, message: str) -> RegistryError:
        return self.client.error(message)

    def _not_cached(self, what: str) -> RegistryError:
        return self.error(f"{what} is not in the cache and --smol-offline forbids pulling "
                          f"(pre-pull it: pytest-smolvm pull {self.ref.reference})")

    def top_digest(self, run_id: str | None) -> str:
        if self.ref.digest:
            return self.ref.digest
        if self.offline:
            known = store.tag_digest(self.ref.canonical)
            if known is None:
                raise self._not_cached(f"tag {self.ref.tag}")
            return known
        # Under a lock per tag: xdist workers that need the same marker image at once ask once.
        with store.tag_lock(self.ref.canonical):
            known = store.tag_digest(self.ref.canonical, run_id=run_id) if run_id is not None else None
            if known is not None and store.has(known):
                return known  # this run already asked the registry
            assert self.ref.tag is not None
            body, _ = self.client.manifest(self.ref.tag)
            digest = f"sha256:{hashlib.sha256(body).hexdigest()}"
            store.put_bytes(digest, body)
            store.remember_tag(self.ref.canonical, digest, run_id)
        return digest

    def _json_blob(self, digest: Any, what: str, *, manifest: bool) -> dict[str, Any]:
        self._check_digest(digest, what)
        # Checked again when read from the cache: a damaged copy is dropped and pulled again.
        body = store.read_verified(digest, MAX_CONFIG)
        if body is None:
            if self.offline:
                raise self._not_cached(what)
            with store.blob_lock(digest):  # concurrent first pulls download it once, like a layer
                body = store.read_verified(digest, MAX_CONFIG)  # another pull stored it while we waited
                if body is None:
                    body = self._download_json(digest, what, manifest=manifest)
        try:
            data = json.loads(body)
        except ValueError:
            raise self.error(f"{what} {digest[:19]} is not JSON") from None
        if not isinstance(data, dict):
            raise self.error(f"{what} {digest[:19]} is not a JSON object")
        return data

    def _download_json(self, digest: str, what: str, *, manifest: bool) -> bytes:
        if manifest:
            body, _ = self.client.manifest(digest)
        else:
            try:
                with self.client.blob(digest) as response:
                    body = response.read(MAX_CONFIG + 1)
            except (OSError, HTTPException) as exc:
                raise self.error(f"reading {what} {digest[:19]} broke off: {exc!r}") from None
        try:
            store.put_bytes(digest, body)
        except DigestMismatch:
            raise self.error(f"{what} {digest[:19]} from {self.ref.registry} does not match its digest "
                             "(corrupt or tampered); nothing was cached") from None
        return body

    def _check_digest(self, digest: Any, what: str) -> None:
        """Registry data names files in the cache: only a well-formed sha256 digest may do that."""
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise self.error(f"the registry names {what} by {str(digest)[:80]!r}, not a sha256 digest")

    def platform_manifest(self, digest: str) -> str:
        """The manifest for this host: ``digest`` itself, or its index's entry for this platform."""
        for _depth in range(3):  # an index of indexes is allowed, a loop of them is not
            data = self._json_blob(digest, "manifest", manifest=True)
            if data.get("schemaVersion") == 1:
                raise self.error("is a Docker schema 1 image, which registries stopped serving; rebuild it")
            if "manifests" not in data:
                return digest
            digest = self._pick(data["manifests"])
        raise self.error("index nesting is deeper than 3")

    def _pick(self, entries: Any) -> str:
        arch, variant = host_platform()
        offered = []
        for entry in entries if isinstance(entries, list) else []:
            plat = entry.get("platform") if isinstance(entry, dict) else None
            if not isinstance(plat, dict):
                continue
            offered.append(f"{plat.get('os')}/{plat.get('architecture')}"
                           + (f"/{plat['variant']}" if plat.get("variant") else ""))
            if plat.get("os") == "linux" and plat.get("architecture") == arch \
                    and (not variant or plat.get("variant") in (None, "", variant)):
                digest = entry.get("digest")
                if isinstance(digest, str):
                    return digest
        raise self.error(f"has no linux/{arch}{'/' + variant if variant else ''} image "
                         f"(it offers {', '.join(offered) or 'nothing'})")

    def ensure_blobs(self, manifest_digest: str) -> None:
        """Config and layers into the cache, each verified; skipped when already unpacked here."""
        if unpacked_marker(manifest_digest).is_file():
            return  # the rootfs exists: its layers are not needed again
        manifest = self._json_blob(manifest_digest, "manifest", manifest=True)
        config = manifest.get("config")
        layers = manifest.get("layers")
        if not isinstance(config, dict) or not isinstance(layers, list) \
                or not all(isinstance(layer, dict) for layer in layers):
            raise self.error(f"manifest {manifest_digest[:19]} is not an image manifest (no config or layers)")
        self._json_blob(config["digest"], "image config", manifest=False)
        for layer in layers:
            media_type = str(layer.get("mediaType", ""))
            if media_type not in LAYER_TYPES:
                raise self.error(f"layer {str(layer.get('digest'))[:19]} has media type {media_type!r}, "
                                 "not a filesystem layer")
            self._check_digest(layer.get("digest"), "a layer")
            if not isinstance(layer.get("size"), int) or layer["size"] <= 0:
                # The size bounds the download: a registry cannot stream more than the manifest says.
                raise self.error(f"manifest {manifest_digest[:19]} lists a layer without a size")
        missing = [layer for layer in layers if not store.has(layer["digest"])]
        if missing and self.offline:
            raise self._not_cached(f"{len(missing)} of its {len(layers)} layer(s)")
        total = sum(int(layer["size"]) for layer in missing)
        progress = Progress(f"pulling {self.ref.reference}")
        done = 0
        pulled = 0

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            progress.update(f"layer {pulled + 1}/{len(missing)}, {megabytes(done)} of {megabytes(total)}")

        for layer in missing:
            digest: str = layer["digest"]

            def open_blob(digest: str = digest) -> IO[bytes]:
                return self.client.blob(digest)

            try:
                _, downloaded = store.fetch(digest, int(layer["size"]), open_blob, on_bytes)
            except DigestMismatch:
                raise self.error(f"layer {digest[:19]} from {self.ref.registry} is corrupt (its bytes do not "
                                 "match its digest); nothing was cached") from None
            except (OSError, HTTPException) as exc:
                raise self.error(f"download of layer {digest[:19]} from {self.ref.registry} broke off: "
                                 f"{exc}; nothing was cached") from None
            pulled += downloaded
        if pulled:
            progress.done(f"pulled {pulled} layer(s), {megabytes(done)}")


def unpack_image(manifest_path: Path, dest: Path, title: str) -> dict[str, Any]:
    """Apply the cached layers of the manifest at ``manifest_path`` over ``dest``; the image config.

    The manifest and config are checked against their digests, and each layer is hashed again
    as it is extracted, so a blob damaged in the cache since it was pulled fails the unpack
    (whose staging dir the caller removes) instead of being used, and leaves the cache: the
    next run pulls it again instead of failing the same way.
    """
    from pytest_smolvm.baselines.archive import apply_layer, decompressed
    from pytest_smolvm.errors import UsageError

    try:
        manifest = json.loads(_cached(f"sha256:{manifest_path.name}"))
        config = json.loads(_cached(manifest["config"]["digest"]))
        layers = manifest["layers"]
        total = sum(int(layer.get("size", 0)) for layer in layers)
        progress = Progress(f"unpacking {title}")
        done = 0

        for i, layer in enumerate(layers, 1):
            def on_bytes(n: int, i: int = i) -> None:
                nonlocal done
                done += n
                progress.update(f"layer {i}/{len(layers)}, {megabytes(done)} of {megabytes(total)}")

            with open(store.blob_path(layer["digest"]), "rb") as f:
                reader = store.HashingReader(f, on_bytes)
                try:
                    apply_layer(decompressed(reader), dest, squash_owner=False)  # type: ignore[arg-type]
                except UsageError:
                    # A damaged cached blob can break the stream before its end is read (a bad
                    # gzip trailer): the digest says whether the cache, not the image, is at fault.
                    reader.verify(layer["digest"])
                    raise
                reader.verify(layer["digest"])
        progress.done(f"{len(layers)} layer(s) unpacked")
    except DigestMismatch as exc:
        store.discard(str(exc))
        raise UsageError(f"--smol-baseline={title}: cached blob {str(exc)[:19]} is damaged; it was removed "
                         "from the cache: run again to pull it again") from None
    except FileNotFoundError as exc:
        raise UsageError(f"--smol-baseline={title}: {exc.filename} left the cache while unpacking; "
                         "run again to pull it") from None
    image_config = config.get("config") if isinstance(config, dict) else None
    return dict(image_config) if isinstance(image_config, dict) else {}


def _cached(digest: str) -> bytes:
    """A cached manifest or config, checked against its digest (DigestMismatch if damaged)."""
    path = store.blob_path(digest)
    if not path.is_file():
        raise FileNotFoundError(2, "not in the cache", str(path))
    data = store.read_verified(digest, MAX_CONFIG)
    if data is None:
        raise DigestMismatch(digest)
    return data
