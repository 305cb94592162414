"""What comes out of a guest is judged by resolution and normalised before the host uses it.

Hostile archives fed to the host-side extractor directly, as a guest could stream them out of
``copy_out`` or a warm export: links that stay inside by their spelling and leave by their
resolution, metadata bombs, modes a host user could be harmed by. The "host" is a canary
under this test's tmp dir.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from pytest_smolvm import hostfs, paths
from pytest_smolvm.baseline import apply_layer
from pytest_smolvm.vm import VM
from tests.security.test_extract import PAYLOAD, _dir, _file, _sym, _tar

COPY = hostfs.Policy("copy_out", prefix=PAYLOAD)


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    path = tmp_path / "dest"
    path.mkdir()
    return path


# ------------------------------------------------------------------ links by resolution (issue 23.2)


def test_a_link_inside_by_spelling_but_outside_by_resolution_is_refused(tmp_path: Path, dest: Path) -> None:
    """The issue's tree: ``d/up -> ..`` makes ``d/up/d/up/...`` climb no higher than its spelling says."""
    host = tmp_path / "host-secret"
    host.write_text("host data")
    up = "../" * 8 + str(host).lstrip("/")

    def build(tar: tarfile.TarFile) -> None:
        _dir(tar, PAYLOAD)
        _dir(tar, f"{PAYLOAD}/d")
        _sym(tar, f"{PAYLOAD}/d/up", "..")
        _sym(tar, f"{PAYLOAD}/evil", "d/up/d/up/d/up/" + up)

    with pytest.raises(hostfs.UnsafeArchive, match=r"'payload/evil'.*resolves outside the copied tree"):
        hostfs.extract(io.BytesIO(_tar(build)), dest, COPY)


def test_a_link_made_later_cannot_turn_an_earlier_one_outward(dest: Path) -> None:
    """``evil -> p/x`` dangles when it is made; ``p -> ..`` comes after: only the finished tree tells."""
    def build(tar: tarfile.TarFile) -> None:
        _dir(tar, PAYLOAD)
        _sym(tar, f"{PAYLOAD}/evil", "p/x")
        _sym(tar, f"{PAYLOAD}/p", "..")

    with pytest.raises(hostfs.UnsafeArchive, match="resolves outside the copied tree"):
        hostfs.extract(io.BytesIO(_tar(build)), dest, COPY)


def _inward_tree(tar: tarfile.TarFile, *, loop: bool) -> None:
    _dir(tar, PAYLOAD)
    _dir(tar, f"{PAYLOAD}/lib")
    _file(tar, f"{PAYLOAD}/lib/real", b"data")
    _sym(tar, f"{PAYLOAD}/l", "lib")
    _sym(tar, f"{PAYLOAD}/via", "l/../lib/./real")
    _sym(tar, f"{PAYLOAD}/lib/self", "../l/real")
    _sym(tar, f"{PAYLOAD}/dangling", "no/such/file")
    if loop:
        _sym(tar, f"{PAYLOAD}/loop", "loop")


def test_links_that_resolve_inside_are_kept_and_a_loop_is_refused(tmp_path: Path) -> None:
    kept, looped = tmp_path / "kept", tmp_path / "looped"
    kept.mkdir()
    looped.mkdir()
    hostfs.extract(io.BytesIO(_tar(lambda tar: _inward_tree(tar, loop=False))), kept, COPY)
    assert (kept / PAYLOAD / "via").read_bytes() == b"data"
    assert (kept / PAYLOAD / "lib" / "self").read_bytes() == b"data"
    assert os.readlink(kept / PAYLOAD / "dangling") == "no/such/file"
    with pytest.raises(hostfs.UnsafeArchive, match="'payload/loop'"):  # resolves nowhere
        hostfs.extract(io.BytesIO(_tar(lambda tar: _inward_tree(tar, loop=True))), looped, COPY)


def test_copy_out_of_the_issue_s_tree_from_a_guest(vm: VM, tmp_path: Path) -> None:
    """The same tree, made by a guest's own hands and streamed by its own tar."""
    host = tmp_path / "host-secret"
    host.write_text("host data")
    up = "../" * 8 + str(host).lstrip("/")
    vm.exec(f"mkdir -p /t/d && ln -s .. /t/d/up && ln -s d/up/d/up/d/up/{up} /t/evil", check=True)
    with pytest.raises(hostfs.UnsafeArchive, match="resolves outside the copied tree"):
        vm.copy_out("/t", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ bounded metadata (issue 23.5)


class _PaxBomb(io.RawIOBase):
    """Hundreds of 1 MiB pax headers before one member, made as they are read (never held whole)."""

    def __init__(self, headers: int) -> None:
        record = b"comment=" + b"x" * ((1 << 20) - 64)
        size = len(record) + 2
        size = len(f"{size + len(str(size))} ") + len(record) + 1
        payload = f"{size} ".encode() + record + b"\n"
        info = tarfile.TarInfo("././@PaxHeader")
        info.type, info.size = tarfile.XHDTYPE, len(payload)
        header = info.tobuf(tarfile.USTAR_FORMAT)
        self._one = header + payload + bytes(-len(payload) % 512)
        self._left = headers
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        while not self._buf and self._left:
            self._buf, self._left = self._one, self._left - 1
        n = min(len(buffer), len(self._buf))
        buffer[:n], self._buf = self._buf[:n], self._buf[n:]
        return n


def test_piled_up_pax_headers_are_refused_in_bounded_memory(dest: Path) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(hostfs.UnsafeArchive, match="metadata headers"):
            hostfs.extract(io.BufferedReader(_PaxBomb(500)), dest, COPY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak >> 20} MiB held for a pax bomb"


# ------------------------------------------------------------------ modes (issues 23.4 and 23.5)


def test_a_copy_s_directories_are_the_host_user_s_to_clean(dest: Path) -> None:
    def build(tar: tarfile.TarFile) -> None:
        _dir(tar, PAYLOAD)
        _dir(tar, f"{PAYLOAD}/locked", 0o000)
        _file(tar, f"{PAYLOAD}/locked/f")
        _dir(tar, f"{PAYLOAD}/open", 0o777)
        _file(tar, f"{PAYLOAD}/suid", mode=0o4755)

    hostfs.extract(io.BytesIO(_tar(build)), dest, COPY)
    assert stat.S_IMODE((dest / PAYLOAD / "locked").stat().st_mode) == 0o700
    assert stat.S_IMODE((dest / PAYLOAD / "open").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / PAYLOAD / "suid").stat().st_mode) == 0o755


def test_a_warm_export_is_normalised(dest: Path) -> None:
    """What a guest leaves in a warm baseline lands in the host's cache: no setuid shell for any
    local user, no world-writable directory without its sticky bit."""
    def build(tar: tarfile.TarFile) -> None:
        _dir(tar, "bin")
        _file(tar, "bin/sh", b"#!", mode=0o4755)
        _file(tar, "bin/sg", b"#!", mode=0o2755)
        _dir(tar, "open", 0o777)
        _dir(tar, "tmp", 0o1777)
        _dir(tar, "shut", 0o000)

    apply_layer(io.BytesIO(_tar(build)), dest, squash_owner=False, what="warm baseline export", guest_made=True)
    modes = {name: stat.S_IMODE((dest / name).stat().st_mode) for name in ("bin/sh", "bin/sg", "open", "tmp", "shut")}
    assert modes == {"bin/sh": 0o755, "bin/sg": 0o755, "open": 0o755, "tmp": 0o1777, "shut": 0o700}


def test_an_image_layer_keeps_its_own_modes(dest: Path) -> None:
    """The baseline image is trusted: its setuid binaries (su, passwd) stay what they are."""
    apply_layer(io.BytesIO(_tar(lambda tar: _file(tar, "su", b"#!", mode=0o4755))), dest, squash_owner=False)
    assert stat.S_IMODE((dest / "su").stat().st_mode) == 0o4755


def test_cache_and_state_dirs_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh, old = tmp_path / "fresh", tmp_path / "old"
    old.mkdir(mode=0o755)
    old.chmod(0o755)  # as an earlier version left it
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(fresh))
    monkeypatch.setenv("PYTEST_SMOLVM_STATE_DIR", str(old))
    paths.private.cache_clear()
    assert stat.S_IMODE(paths.cache_dir().stat().st_mode) == 0o700
    assert stat.S_IMODE(paths.state_dir().stat().st_mode) == 0o700
