"""Baselines from every supported source: rootfs tarballs, docker-save and OCI archives.

The archives are built here from the bundled Alpine rootfs plus small hand-made layers, so
whiteouts, opaque directories and the image config's Env/WorkingDir are exercised for real.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from pytest_smolvm.baselines.baseline import bundled_rootfs_tarball

PROBE_TEST = """
def test_sees_the_image(smol_vm):
    assert smol_vm.exec("cat /etc/alpine-release").exit_code == 0          # the base layer
    assert smol_vm.exec("cat /opt/app/version").stdout == "2\\n"            # the upper layer wins
    assert smol_vm.exec("test -e /etc/motd").exit_code == 1                # removed by a whiteout
    assert smol_vm.exec("ls /opt/gone").stdout.split() == ["new"]          # opaque: old content gone
    assert smol_vm.exec("echo $APP_MODE").stdout == "layered\\n"           # the image config's Env
    assert smol_vm.exec("pwd").stdout == "/opt/app\\n"                     # and its WorkingDir
"""


def _tar_bytes(entries: list[tuple[str, bytes | None]]) -> bytes:
    """A layer: (name, content) files; content None makes a directory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(content), 0o644
                tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def _base_layer() -> bytes:
    """The bundled Alpine rootfs as an uncompressed layer, plus /opt/gone/keep to be hidden later."""
    import zstandard

    with open(bundled_rootfs_tarball(), "rb") as raw:
        base = zstandard.ZstdDecompressor().stream_reader(raw).read()
    extra = _tar_bytes([("opt/gone", None), ("opt/gone/keep", b"old"), ("opt/app", None),
                        ("opt/app/version", b"1\n")])
    # Concatenate the two archives' members into one tar.
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as dst:
        for blob in (base, extra):
            with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as src:
                for member in src.getmembers():
                    dst.addfile(member, src.extractfile(member) if member.isreg() else None)
    return out.getvalue()


UPPER_LAYER = _tar_bytes([("opt/app/version", b"2\n"), ("etc/.wh.motd", b""),
                          ("opt/gone/.wh..wh..opq", b""), ("opt/gone/new", b"fresh")])
CONFIG = {"config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "APP_MODE=layered"],
                     "WorkingDir": "/opt/app"}}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def docker_save(path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        _add(tar, "base/layer.tar", _base_layer())
        _add(tar, "upper/layer.tar", UPPER_LAYER)
        _add(tar, "config.json", json.dumps(CONFIG).encode())
        _add(tar, "manifest.json", json.dumps([{"Config": "config.json", "RepoTags": ["t:1"],
                                                 "Layers": ["base/layer.tar", "upper/layer.tar"]}]).encode())
    return path


def oci_archive(path: Path) -> Path:
    import gzip

    blobs = {}

    def blob(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest

    layers = [blob(gzip.compress(_base_layer(), compresslevel=1)), blob(UPPER_LAYER)]
    config = blob(json.dumps(CONFIG).encode())
    manifest = blob(json.dumps({"config": {"digest": config},
                                "layers": [{"digest": d} for d in layers]}).encode())
    with tarfile.open(path, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", json.dumps({"manifests": [{"digest": manifest}]}).encode())
        for digest, data in blobs.items():
            _add(tar, f"blobs/sha256/{digest.split(':')[1]}", data)
    return path


@pytest.mark.parametrize("make", [docker_save, oci_archive], ids=["docker-save", "oci"])
def test_image_archive_layers_whiteouts_and_config(pytester: pytest.Pytester, smol_state: Path,
                                                    make: object) -> None:
    archive = make(pytester.path / "image.tar")  # type: ignore[operator]
    pytester.makepyfile(PROBE_TEST)
    result = pytester.runpytest_subprocess(f"--smol-baseline={archive}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"smolvm: baseline {archive} (image-archive, sha256:*)"])


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_rootfs_tarballs(pytester: pytest.Pytester, smol_state: Path, suffix: str) -> None:
    import gzip

    data = _base_layer()
    path = pytester.path / f"rootfs{suffix}"
    path.write_bytes(gzip.compress(data, compresslevel=1) if suffix == ".tar.gz" else data)
    pytester.makepyfile("""
        def test_rootfs(smol_vm):
            assert smol_vm.exec("cat /opt/app/version /opt/gone/keep").stdout == "1\\nold"
    """)
    result = pytester.runpytest_subprocess(f"--smol-baseline={path}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"smolvm: baseline {path} (rootfs-tar, sha256:*)"])


@pytest.mark.parametrize("attack", ["dotdot", "through-a-link"])
def test_hostile_rootfs_archives_are_refused(pytester: pytest.Pytester, smol_state: Path, attack: str) -> None:
    outside = pytester.mkdir("outside")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        if attack == "dotdot":
            _add(tar, "../escape", b"x")
        else:  # a symlink to a host dir, then a member written through it
            link = tarfile.TarInfo("lib")
            link.type, link.linkname = tarfile.SYMTYPE, str(outside)
            tar.addfile(link)
            _add(tar, "lib/planted", b"x")
    path = pytester.path / "evil.tar"
    path.write_bytes(buffer.getvalue())
    pytester.makepyfile("def test_x(smol_vm):\n    pass\n")
    result = pytester.runpytest_subprocess(f"--smol-baseline={path}")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["--smol-baseline: archive member * outside the rootfs"])
    assert not (pytester.path / "escape").exists()
    assert not (outside / "planted").exists()


def test_a_directory_that_is_not_a_rootfs_is_one_line_at_the_first_guest(pytester: pytest.Pytester,
                                                                          smol_state: Path) -> None:
    """Not a deep FileNotFoundError for '/bin/sh' in every test: one line, and the run stops."""
    pytester.mkdir("not-a-rootfs").joinpath("notes.txt").write_text("a project dir, given by mistake\n")
    pytester.makepyfile("""
        def test_one(smol_vm):
            smol_vm.exec("true")

        def test_two(smol_vm):
            smol_vm.exec("true")
    """)
    result = pytester.runpytest_subprocess("--smol-baseline=not-a-rootfs")
    result.assert_outcomes(errors=1)
    text = result.stdout.str()
    assert "--smol-baseline=not-a-rootfs: not a root filesystem: no /bin/sh" in text, text
    assert "Traceback" not in text and "FileNotFoundError" not in text, text


def test_a_rootfs_shell_is_looked_up_as_the_guest_would(tmp_path: Path) -> None:
    """Links are followed inside the tree: merged /usr counts, and no link reaches the host's /bin/sh."""
    from pytest_smolvm.baselines.baseline import in_root_exists

    merged = tmp_path / "merged"
    (merged / "usr" / "bin").mkdir(parents=True)
    (merged / "usr" / "bin" / "busybox").write_text("")
    (merged / "usr" / "bin" / "sh").symlink_to("/usr/bin/busybox")  # absolute: from the rootfs
    (merged / "bin").symlink_to("usr/bin")
    assert in_root_exists(merged, "/bin/sh")
    host_link = tmp_path / "host-link"
    host_link.mkdir()
    (host_link / "bin").symlink_to("/bin")  # the host's /bin has a sh; this tree has none
    assert Path("/bin/sh").exists() and not in_root_exists(host_link, "/bin/sh")
    dotdot = tmp_path / "dotdot"
    dotdot.mkdir()
    (dotdot / "bin").symlink_to("../../../../../../bin")  # '..' stops at the tree's root
    assert not in_root_exists(dotdot, "/bin/sh")
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "bin").symlink_to("bin")
    assert not in_root_exists(loop, "/bin/sh")
    directory = tmp_path / "dir"
    (directory / "bin" / "sh").mkdir(parents=True)
    assert not in_root_exists(directory, "/bin/sh")
