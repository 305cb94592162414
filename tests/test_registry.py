"""Registry images as baselines, pulled from a real registry on 127.0.0.1 (no test reaches the internet)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from pytest_smolvm.baselines import cache as baselines
from pytest_smolvm.baselines.oci import store
from pytest_smolvm.baselines.oci.auth import Credentials, lookup, parse_auth_option
from pytest_smolvm.baselines.oci.pull import resolve_image
from pytest_smolvm.baselines.oci.reference import parse
from pytest_smolvm.errors import UsageError
from pytest_smolvm.session.settings import Settings
from tests.registry_fixtures import PRIVATE_USER, Images, no_partial_files
from tests.registry_server import ProxyConfig, Registry, free_port, proxy

# --------------------------------------------------------------------------- references and auth


@pytest.mark.parametrize(("reference", "expected"), [
    ("python:3.12-slim", ("docker.io", "library/python", "3.12-slim", "https")),
    ("alpine", ("docker.io", "library/alpine", "latest", "https")),
    ("someone/tool:2", ("docker.io", "someone/tool", "2", "https")),
    ("ghcr.io/org/img:v1.2", ("ghcr.io", "org/img", "v1.2", "https")),
    ("localhost:5000/acc/alpine:1", ("localhost:5000", "acc/alpine", "1", "http")),
    ("127.0.0.1:5000/acc/alpine", ("127.0.0.1:5000", "acc/alpine", "latest", "http")),
    ("[::1]:5000/x:y", ("[::1]:5000", "x", "y", "http")),
    ("registry.example.com:443/a/b/c:t", ("registry.example.com:443", "a/b/c", "t", "https")),
])
def test_references_follow_dockers_defaults(reference: str, expected: tuple[str, str, str, str]) -> None:
    ref = parse(reference)
    assert (ref.registry, ref.repository, ref.tag, ref.scheme) == expected
    if ref.registry == "docker.io":
        assert ref.api_host == "registry-1.docker.io"


def test_a_digest_reference_pins_without_a_tag() -> None:
    digest = "sha256:" + "ab" * 32
    ref = parse(f"alpine@{digest}")
    assert (ref.repository, ref.tag, ref.digest) == ("library/alpine", None, digest)


@pytest.mark.parametrize("reference", ["Alpine:3", "alpine:", "alpine@sha256:xyz", "a//b", "alpine:bad tag"])
def test_bad_references_are_one_line_errors(reference: str) -> None:
    with pytest.raises(UsageError, match=r"^--smol-baseline=.*not an image reference") as info:
        parse(reference)
    assert "\n" not in str(info.value)


def test_auth_option_forms() -> None:
    assert parse_auth_option("u:p=w") == (None, parse_auth_option("u:p=w")[1])
    registry, creds = parse_auth_option("127.0.0.1:5000=bob:pa:ss")
    assert (registry, creds.username, creds.password) == ("127.0.0.1:5000", "bob", "pa:ss")
    with pytest.raises(UsageError, match="--smol-registry-auth: expected"):
        parse_auth_option("no-colon")


def _found(registry: str, option_value: str | None) -> Credentials:
    """lookup's credentials for ``registry``, which it must have."""
    credentials = lookup(registry, option_value)
    assert credentials is not None, f"no credentials for {registry}"
    return credentials


def test_docker_config_auths_and_credential_helpers(oci_cache: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    docker = tmp_path / "docker"
    docker.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "docker-credential-fake"
    helper.write_text('#!/bin/sh\nread server\n'
                      'echo "{\\"Username\\": \\"helper-user\\", \\"Secret\\": \\"$server\\"}"\n')
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (docker / "config.json").write_text(json.dumps({
        "auths": {"https://index.docker.io/v1/": {"auth": "aHViOnNlY3JldA=="},  # hub:secret
                  "http://reg.example:5000": {"username": "plain", "password": "pw"}},
        "credHelpers": {"helped.example": "fake"}}))
    assert lookup("docker.io", None) == Credentials("hub", "secret")
    assert (_found("reg.example:5000", None).username, _found("reg.example:5000", None).password) == ("plain", "pw")
    assert (_found("helped.example", None).username, _found("helped.example", None).password) == \
        ("helper-user", "helped.example")
    assert lookup("unknown.example", None) is None
    monkeypatch.setenv("PYTEST_SMOLVM_REGISTRY_AUTH", "reg.example:5000=env:var")
    assert _found("reg.example:5000", None).username == "env"
    assert _found("reg.example:5000", "opt:ion").username == "opt"  # the option wins over the env


def test_a_missing_credential_helper_names_its_install(oci_cache: Path, tmp_path: Path) -> None:
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "config.json").write_text(json.dumps({"credsStore": "nosuchhelper"}))
    with pytest.raises(UsageError, match="docker-credential-nosuchhelper, which is not installed"):
        lookup("any.example", None)


# --------------------------------------------------------------------------- pulling


def _settings(**changes: object) -> Settings:
    return Settings(**changes)  # type: ignore[arg-type]


def test_pull_pins_the_manifest_digest_and_reuses_layers(oci_registry: Images, oci_cache: Path) -> None:
    reference = f"{oci_registry.host}/acc/alpine:1"
    before = len(oci_registry.registry.requests())
    base = resolve_image(reference, _settings(), run_id="run-1")
    assert (base.kind, base.digest) == ("registry", oci_registry.alpine)
    first = oci_registry.registry.requests()[before:]
    assert [p for m, p, _ in first if "/blobs/" in p], first  # config and layer were fetched

    rootfs = baselines.unpack(base)
    assert (rootfs.path / "bin" / "busybox").exists()
    assert rootfs.env["ACC_IMAGE"] == "1" and rootfs.workdir == "/" and rootfs.user == ""

    mark = len(oci_registry.registry.requests())
    assert resolve_image(reference, _settings(), run_id="run-1") == base
    assert oci_registry.registry.requests()[mark:] == []  # the same run never asks twice
    assert resolve_image(reference, _settings(), run_id="run-2").digest == base.digest
    again = oci_registry.registry.requests()[mark:]
    assert [p for _, p, _ in again] == ["/v2/acc/alpine/manifests/1"]  # a new run re-resolves the tag only

    # Another image on the same base layer downloads only what it does not share.
    mark = len(oci_registry.registry.requests())
    layers = resolve_image(f"{oci_registry.host}/acc/layers:1", _settings(), run_id="run-2")
    blob_gets = [p for m, p, _ in oci_registry.registry.requests()[mark:] if m == "GET" and "/blobs/" in p]
    manifest = json.loads(layers.path.read_text())  # type: ignore[union-attr]
    assert sorted(blob_gets) == sorted(f"/v2/acc/layers/blobs/{d}" for d in
                                       (manifest["config"]["digest"], manifest["layers"][1]["digest"]))


def test_pinned_digest_and_offline_work_from_the_cache(oci_registry: Images, oci_cache: Path) -> None:
    pinned = f"{oci_registry.host}/acc/alpine@{oci_registry.alpine}"
    with pytest.raises(UsageError, match=r"not in the cache and --smol-offline forbids pulling.*pytest-smolvm pull"):
        resolve_image(pinned, _settings(offline=True))
    resolve_image(pinned, _settings())
    mark = len(oci_registry.registry.requests())
    assert resolve_image(pinned, _settings()).digest == oci_registry.alpine  # no network for a cached digest
    assert oci_registry.registry.requests()[mark:] == []
    with pytest.raises(UsageError, match="tag 1 is not in the cache"):
        resolve_image(f"{oci_registry.host}/acc/alpine:1", _settings(offline=True))
    resolve_image(f"{oci_registry.host}/acc/alpine:1", _settings(), run_id="r")
    mark = len(oci_registry.registry.requests())
    assert resolve_image(f"{oci_registry.host}/acc/alpine:1", _settings(offline=True), run_id="other").digest \
        == oci_registry.alpine
    assert oci_registry.registry.requests()[mark:] == []


def test_a_multi_platform_index_resolves_to_this_host(oci_registry: Images, oci_cache: Path) -> None:
    base = resolve_image(f"{oci_registry.host}/acc/multi:1", _settings())
    assert base.digest == oci_registry.multi  # the digest the tag names, as 'docker pull' prints
    assert base.path == store.blob_path(oci_registry.multi_host)
    rootfs = baselines.unpack(base)
    assert (rootfs.path / "bin" / "busybox").exists() and not (rootfs.path / "OTHER-ARCH").exists()


def test_whiteouts_opaque_dirs_and_the_image_config(oci_registry: Images, oci_cache: Path) -> None:
    rootfs = baselines.unpack(resolve_image(f"{oci_registry.host}/acc/layers:1", _settings()))
    assert not (rootfs.path / "etc" / "motd").exists()
    assert sorted(os.listdir(rootfs.path / "etc" / "apk")) == ["only-this"]
    assert (rootfs.path / "srv" / "app" / "hello.txt").read_text() == "from layer two\n"
    assert (rootfs.path / "etc" / "os-release").exists()  # the first layer is still there
    assert rootfs.env["GREETING"] == "hello from the image"
    assert (rootfs.workdir, rootfs.user) == ("/srv/app", "nobody")


def test_anonymous_bearer_tokens(oci_registry: Images, oci_cache: Path) -> None:
    config = ProxyConfig(oci_registry.host, bearer=True)
    with proxy(config) as host:
        base = resolve_image(f"{host}/acc/alpine:1", _settings())
    assert base.digest == oci_registry.alpine
    assert config.tokens_issued == 1  # one token serves every request of the pull


def test_a_private_repository_needs_credentials(private_registry: Registry, oci_cache: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    reference = f"{private_registry.host}/acc/private:1"
    with pytest.raises(UsageError) as info:
        resolve_image(reference, _settings())
    message = str(info.value)
    assert message.startswith(f"--smol-baseline={reference}: registry {private_registry.host} refused access")
    assert "docker login" in message and "--smol-registry-auth" in message and "\n" not in message
    with pytest.raises(UsageError, match="credentials given were refused"):
        resolve_image(reference, _settings(registry_auth="alice:wrong"))
    assert resolve_image(reference, _settings(registry_auth=":".join(PRIVATE_USER))).kind == "registry"
    monkeypatch.setenv("PYTEST_SMOLVM_REGISTRY_AUTH", f"{private_registry.host}={':'.join(PRIVATE_USER)}")
    assert resolve_image(reference, _settings(), run_id="env").kind == "registry"
    monkeypatch.delenv("PYTEST_SMOLVM_REGISTRY_AUTH")
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "config.json").write_text(json.dumps({"auths": {private_registry.host: {
        "username": PRIVATE_USER[0], "password": PRIVATE_USER[1]}}}))
    assert resolve_image(reference, _settings(), run_id="config").kind == "registry"


def test_unknown_tags_and_unreachable_registries(oci_registry: Images, oci_cache: Path) -> None:
    reference = f"{oci_registry.host}/acc/alpine:nope"
    with pytest.raises(UsageError, match=rf"^--smol-baseline={reference}: no such image on .*check the name"):
        resolve_image(reference, _settings())
    dead = f"127.0.0.1:{free_port()}/acc/alpine:1"
    with pytest.raises(UsageError, match=rf"^--smol-baseline={dead}: cannot reach registry 127.0.0.1") as info:
        resolve_image(dead, _settings())
    # ... and what a user without a network can do instead, on the same line
    message = str(info.value)
    assert "\n" not in message
    assert f"'pytest-smolvm pull {dead}'" in message and "--smol-offline" in message and "tarball" in message
    assert no_partial_files(oci_cache) == []


def test_a_corrupt_layer_is_refused_and_nothing_is_cached(oci_registry: Images, oci_cache: Path) -> None:
    manifest = json.loads(oci_registry.registry._call(
        "GET", f"/v2/acc/alpine/manifests/{oci_registry.alpine}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).read())
    layer = manifest["layers"][0]["digest"]
    config = ProxyConfig(oci_registry.host, corrupt_blobs={layer})
    with proxy(config) as host, pytest.raises(UsageError) as info:
        resolve_image(f"{host}/acc/alpine:1", _settings())
    assert str(info.value) == (f"--smol-baseline={host}/acc/alpine:1: layer {layer[:19]} from {host} is corrupt "
                               "(its bytes do not match its digest); nothing was cached")
    assert not store.has(layer) and no_partial_files(oci_cache) == []


def test_a_layer_damaged_in_the_cache_fails_the_unpack_cleanly(oci_registry: Images, oci_cache: Path) -> None:
    base = resolve_image(f"{oci_registry.host}/acc/alpine:1", _settings())
    layer = json.loads(base.path.read_text())["layers"][0]["digest"]  # type: ignore[union-attr]
    blob = store.blob_path(layer)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # the gzip trailer: extraction succeeds, only the digest can tell
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="is damaged; it was removed from the cache"):
        baselines.unpack(base)
    assert not (oci_cache / "baselines" / base.path.name[:32]).exists()  # type: ignore[union-attr]
    assert no_partial_files(oci_cache) == []


@pytest.mark.parametrize("manifest", [
    {"schemaVersion": 2, "config": {"digest": "sha256:../../../etc/passwd"}, "layers": []},
    {"schemaVersion": 2, "config": "nope", "layers": []},
    {"schemaVersion": 2, "manifests": [{"platform": "linux", "digest": "sha256:" + "0" * 64}]},
    {"schemaVersion": 1, "fsLayers": []},
], ids=["traversal-digest", "config-not-object", "platform-not-object", "schema1"])
def test_hostile_manifests_are_one_line_errors(manifest: dict[str, object], oci_cache: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_smolvm.baselines.oci.client import Client

    body = json.dumps(manifest).encode()
    monkeypatch.setattr(Client, "manifest", lambda self, reference: (body, ""))
    with pytest.raises(UsageError, match=r"^--smol-baseline=127.0.0.1:1/evil:1: ") as info:
        resolve_image("127.0.0.1:1/evil:1", _settings())
    assert "\n" not in str(info.value)
    assert not (oci_cache / "etc").exists() and no_partial_files(oci_cache) == []


def test_token_service_credentials_from_docker_config(oci_registry: Images, oci_cache: Path, tmp_path: Path) -> None:
    config = ProxyConfig(oci_registry.host, bearer=True, token_user=("carol", "tok-pw"))
    (tmp_path / "docker").mkdir()
    with proxy(config) as host:
        with pytest.raises(UsageError, match=r"refused access .*no credentials found"):
            resolve_image(f"{host}/acc/alpine:1", _settings())
        (tmp_path / "docker" / "config.json").write_text(json.dumps({"auths": {host: {"identitytoken": "refresh-me"}}}))
        assert resolve_image(f"{host}/acc/alpine:1", _settings(), run_id="a").digest == oci_registry.alpine
        assert "POST /token" in config.paths  # the refresh token went through the OAuth2 exchange
        (tmp_path / "docker" / "config.json").write_text(json.dumps({"auths": {f"http://{host}": {
            "auth": base64.b64encode(b"carol:tok-pw").decode()}}}))
        assert resolve_image(f"{host}/acc/alpine:1", _settings(), run_id="b").digest == oci_registry.alpine
