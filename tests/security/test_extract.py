"""The host-side extraction on its own, fed hostile archives directly (no guest involved).

Every case is a tree a guest could stream out of ``copy_out`` or a warm export (or an image
layer could carry). The published proof-of-concept shapes of CVE-2025-4517, CVE-2025-4330,
CVE-2025-4138 and CVE-2024-12718 get past ``tarfile``'s ``data`` filter on Python 3.11.7; here
they must not put, change or link anything outside the destination. The "host" they aim at
is a canary dir under this test's tmp dir: harmless if an attack succeeds.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pytest_smolvm.baselines.archive import apply_layer
from pytest_smolvm.errors import UnsafeArchive, UsageError
from pytest_smolvm.untrusted import confined, hostfs, rules

PAYLOAD = "payload"


class Canary:
    """A dir outside the destination with a file, watched for any change."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "host"
        self.dir.mkdir()
        self.file = self.dir / "secret"
        self.file.write_text("host data")
        self.file.chmod(0o600)
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, tuple[int, int, int, bytes]]:
        found = {}
        for path in [self.dir, *self.dir.rglob("*")]:
            st = path.lstat()
            data = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
            found[str(path)] = (st.st_mode, st.st_nlink, st.st_ino, data)
        return found

    def assert_untouched(self) -> None:
        assert self.snapshot() == self.before, "a file outside the destination changed"


@pytest.fixture(autouse=True, params=["in-process", "confined"])
def wall(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each wall on its own: the fd walker in this process, and the same walker in the confined
    helper (its own mount namespace and root, no capabilities, seccomp); apply_layer uses the
    confined one, so it is switched too."""
    if request.param == "in-process":
        monkeypatch.setattr(confined, "extract", hostfs.extract)
    else:
        monkeypatch.setattr(hostfs, "extract", confined.extract)
    return str(request.param)


@pytest.fixture
def canary(tmp_path: Path) -> Canary:
    return Canary(tmp_path)


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    path = tmp_path / "a" / "b" / "dest"
    path.mkdir(parents=True)
    return path


def _tar(build: Callable[[tarfile.TarFile], None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        build(tar)
    return buffer.getvalue()


def _dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    tar.addfile(info)


def _sym(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    tar.addfile(info)


def _hard(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, target
    tar.addfile(info)


def _file(tar: tarfile.TarFile, name: str, data: bytes = b"pwned", mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def _up_to(dest: Path, target: Path) -> str:
    return os.path.relpath(target, dest)


# ------------------------------------------------------------------ the published PoC shapes

_STEPS = "abcdefghijklmnop"


def _past_path_max(tar: tarfile.TarFile, prefix: str, letter: str) -> str:
    """The chain both realpath() PoCs share: nested 247-char dirs, each reached through a
    one-letter symlink, so the resolved path outgrows PATH_MAX while the written one stays
    short. Returns a link at the bottom that climbs back up to `prefix`."""
    comp, path = letter * 247, prefix
    for step in _STEPS:
        _dir(tar, os.path.join(path, comp))
        _sym(tar, os.path.join(path, step), comp)
        path = os.path.join(path, comp)
    link_path = os.path.join(prefix, *_STEPS, "l" * 254)
    _sym(tar, link_path, os.path.join(*[".."] * len(_STEPS)))
    return link_path


def cve_2025_4517(dest: Path, canary: Canary, prefix: str) -> bytes:
    """Nested long-named dirs and symlinks: realpath() stops short of PATH_MAX, the filter
    thinks the final link stays inside, and a file is written through it."""
    def build(tar: tarfile.TarFile) -> None:
        link_path = _past_path_max(tar, prefix, "d")
        escape = os.path.join(link_path, _up_to(dest / prefix if prefix else dest, canary.dir))
        _sym(tar, os.path.join(prefix, "escape"), escape)
        _file(tar, os.path.join(prefix, "escape", "secret"), b"overwritten")
        _file(tar, os.path.join(prefix, "escape", "planted"))
        _hard(tar, os.path.join(prefix, "hl"), os.path.join(prefix, "escape", "secret"))
    return _tar(build)


def cve_2025_4330(dest: Path, canary: Canary, prefix: str) -> bytes:
    """The same chain used for a symlink that points outside, then written through."""
    def build(tar: tarfile.TarFile) -> None:
        link_path = _past_path_max(tar, prefix, "c")
        outside = _up_to(dest / prefix if prefix else dest, canary.dir)
        _sym(tar, os.path.join(prefix, "out"), os.path.join(link_path, outside))
        _file(tar, os.path.join(prefix, "out", "secret"), b"overwritten")
    return _tar(build)


def cve_2025_4138(dest: Path, canary: Canary, prefix: str) -> bytes:
    """A link to a link to outside: each link alone looks fine, the pair escapes."""
    def build(tar: tarfile.TarFile) -> None:
        _dir(tar, os.path.join(prefix, "x") if prefix else "x")
        _sym(tar, os.path.join(prefix, "x", "up"), "..")
        _sym(tar, os.path.join(prefix, "esc"), os.path.join("x", "up", "..", "..", _up_to(dest, canary.dir)))
        _sym(tar, os.path.join(prefix, "x", "chain"), os.path.join("up", "up", "up", "up"))
        _file(tar, os.path.join(prefix, "esc", "planted"))
        _file(tar, os.path.join(prefix, "x", "chain", "planted"))
    return _tar(build)


def cve_2024_12718(dest: Path, canary: Canary, prefix: str) -> bytes:
    """Metadata through links: a dir and a file member named like a link change its target's
    mode and mtime; a hard link to the link's target pulls a host inode into the tree."""
    def build(tar: tarfile.TarFile) -> None:
        _sym(tar, os.path.join(prefix, "m"), str(canary.file))
        _sym(tar, os.path.join(prefix, "d"), str(canary.dir))
        _dir(tar, os.path.join(prefix, "d"), mode=0o777)
        info = tarfile.TarInfo(os.path.join(prefix, "m"))
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o777, 0
        tar.addfile(info)
        _sym(tar, os.path.join(prefix, "s"), str(canary.dir))
        _hard(tar, os.path.join(prefix, "h"), os.path.join(prefix, "s", "secret"))
        _hard(tar, os.path.join(prefix, "abs"), str(canary.file))
    return _tar(build)


def symlink_chain_loop(dest: Path, canary: Canary, prefix: str) -> bytes:
    def build(tar: tarfile.TarFile) -> None:
        _sym(tar, os.path.join(prefix, "p"), "q")
        _sym(tar, os.path.join(prefix, "q"), "p")
        _file(tar, os.path.join(prefix, "p", "x"))
    return _tar(build)


def write_through_plain_link(dest: Path, canary: Canary, prefix: str) -> bytes:
    def build(tar: tarfile.TarFile) -> None:
        _sym(tar, os.path.join(prefix, "lib"), str(canary.dir))
        _file(tar, os.path.join(prefix, "lib", "secret"), b"overwritten")
        _sym(tar, os.path.join(prefix, "rel"), _up_to(dest / prefix if prefix else dest, canary.dir))
        _file(tar, os.path.join(prefix, "rel", "planted"))
    return _tar(build)


SHAPES = [cve_2025_4517, cve_2025_4330, cve_2025_4138, cve_2024_12718, symlink_chain_loop,
          write_through_plain_link]


def _outside(tmp_path: Path, dest: Path) -> set[str]:
    """Every path under tmp_path but outside dest (dest itself is not walked: its names are deep)."""
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) != str(dest)]
        found.update(os.path.join(dirpath, n) for n in dirnames + filenames)
    return found


def _inodes(dest: Path) -> set[int]:
    """The inodes of every regular file under dest, walked by fd (names may exceed PATH_MAX)."""
    found = set()
    for _dirpath, _dirnames, filenames, dirfd in os.fwalk(dest):
        for name in filenames:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                found.add(st.st_ino)
    return found


@pytest.mark.parametrize("shape", SHAPES, ids=[s.__name__ for s in SHAPES])
def test_copy_out_rules_hold_against_poc_trees(shape: Callable[[Path, Canary, str], bytes], dest: Path,
                                               canary: Canary, tmp_path: Path) -> None:
    data = shape(dest, canary, PAYLOAD)
    before = _outside(tmp_path, dest)
    with pytest.raises(UnsafeArchive, match="refused"):
        hostfs.extract(io.BytesIO(data), dest, rules.Policy("copy_out", prefix=PAYLOAD))
    canary.assert_untouched()
    assert _outside(tmp_path, dest) == before


@pytest.mark.parametrize("shape", SHAPES, ids=[s.__name__ for s in SHAPES])
def test_layer_rules_hold_against_poc_trees(shape: Callable[[Path, Canary, str], bytes], dest: Path,
                                            canary: Canary, tmp_path: Path) -> None:
    """A warm export or an image layer: links are kept (a rootfs has absolute ones), but the
    host never resolves one; at worst a member is refused or lands inside the tree."""
    data = shape(dest, canary, "")
    before = _outside(tmp_path, dest)
    try:
        apply_layer(io.BytesIO(data), dest, squash_owner=False)
    except UsageError as exc:
        assert str(exc).startswith("--smol-baseline: ")
    canary.assert_untouched()
    assert _outside(tmp_path, dest) == before
    assert canary.file.stat().st_ino not in _inodes(dest), "a host inode was linked into the tree"


def test_this_python_tarfile_filter_alone_is_not_relied_on(dest: Path, canary: Canary) -> None:
    """Whatever tarfile's data filter does on this Python, hostfs refuses the 4517 tree by itself."""
    data = cve_2025_4517(dest, canary, PAYLOAD)
    with pytest.raises(UnsafeArchive, match=r"leaves the copied tree|is a symlink"):
        hostfs.extract(io.BytesIO(data), dest, rules.Policy("copy_out", prefix=PAYLOAD))


# ------------------------------------------------------------------ kinds, caps and time


@pytest.mark.parametrize("kind", [tarfile.FIFOTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE])
def test_devices_and_fifos_are_refused_on_copy_out(kind: bytes, dest: Path) -> None:
    def build(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(f"{PAYLOAD}/node")
        info.type, info.devmajor, info.devminor = kind, 1, 5
        tar.addfile(info)
    with pytest.raises(UnsafeArchive, match=r"a FIFO|a device"):
        hostfs.extract(io.BytesIO(_tar(build)), dest, rules.Policy("copy_out", prefix=PAYLOAD))
    assert not (dest / PAYLOAD / "node").exists()


def test_dev_zero_link_is_refused(dest: Path) -> None:
    data = _tar(lambda tar: _sym(tar, PAYLOAD, "/dev/zero"))
    with pytest.raises(UnsafeArchive, match="leaves the copied tree"):
        hostfs.extract(io.BytesIO(data), dest, rules.Policy("copy_out", prefix=PAYLOAD))


def test_names_that_leave_the_tree_are_refused(dest: Path) -> None:
    for name in ("/etc/x", f"{PAYLOAD}/../../x", "other"):
        data = _tar(lambda tar, name=name: _file(tar, name))  # type: ignore[misc]
        with pytest.raises(UnsafeArchive, match="refused"):
            hostfs.extract(io.BytesIO(data), dest, rules.Policy("copy_out", prefix=PAYLOAD))


def test_byte_cap_is_checked_while_reading(dest: Path) -> None:
    big = 8 << 20
    data = _tar(lambda tar: _file(tar, f"{PAYLOAD}/big", b"\0" * big))
    with pytest.raises(UnsafeArchive, match="the cap"):
        hostfs.extract(io.BytesIO(data), dest, rules.Policy("copy_out", prefix=PAYLOAD),
                       rules.Caps(max_bytes=1 << 20))
    assert (dest / PAYLOAD / "big").stat().st_size <= 2 << 20  # stopped near the cap, not after


def test_member_cap(dest: Path) -> None:
    def build(tar: tarfile.TarFile) -> None:
        _dir(tar, PAYLOAD)
        for i in range(50):
            _file(tar, f"{PAYLOAD}/f{i}", b"")
    with pytest.raises(UnsafeArchive, match="members"):
        hostfs.extract(io.BytesIO(_tar(build)), dest, rules.Policy("copy_out", prefix=PAYLOAD),
                       rules.Caps(max_members=10))


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar to write a sparse member")
def test_sparse_huge_file_stays_sparse(tmp_path: Path, dest: Path) -> None:
    """A 1 TiB sparse file is a few blocks in the stream, and only those land: its holes stay
    holes, and it counts against the cap by its data."""
    src = tmp_path / "src" / PAYLOAD
    src.mkdir(parents=True)
    with open(src / "huge", "wb") as f:
        f.seek(1 << 40)
        f.write(b"data")
    archive = subprocess.run(["tar", "--sparse", "-c", "-f", "-", "-C", str(src.parent), PAYLOAD],
                             capture_output=True, check=True, timeout=60).stdout
    assert len(archive) < 1 << 20
    started = time.monotonic()
    hostfs.extract(io.BytesIO(archive), dest, rules.Policy("copy_out", prefix=PAYLOAD),
                   rules.Caps(max_bytes=16 << 20))
    assert time.monotonic() - started < 30
    out = dest / PAYLOAD / "huge"
    assert out.stat().st_size == (1 << 40) + 4
    assert out.stat().st_blocks * 512 <= 1 << 20


def test_a_stalled_stream_times_out(dest: Path) -> None:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, _tar(lambda tar: _dir(tar, PAYLOAD))[:512])  # a header, then nothing
    started = time.monotonic()
    try:
        with os.fdopen(read_fd, "rb") as stream, pytest.raises(UnsafeArchive, match="longer than"):
            hostfs.extract(stream, dest, rules.Policy("copy_out", prefix=PAYLOAD), rules.Caps(timeout=1.0))
    finally:
        os.close(write_fd)
    assert time.monotonic() - started < 10


def test_a_spewing_pipe_is_capped(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    writer = threading.Thread(target=lambda: _spew(write_fd), daemon=True)
    writer.start()
    with os.fdopen(read_fd, "rb") as stream, pytest.raises(UnsafeArchive, match="the cap"):
        reader = rules.BoundedReader(stream, max_bytes=1 << 20, timeout=10, what="read")
        while reader.read(1 << 16):
            pass
    writer.join(5)


def _spew(fd: int) -> None:
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------ what must still work


@pytest.fixture
def good_tree() -> Iterator[bytes]:
    def build(tar: tarfile.TarFile) -> None:
        _dir(tar, PAYLOAD, 0o750)
        _dir(tar, f"{PAYLOAD}/sub", 0o700)
        _file(tar, f"{PAYLOAD}/sub/run.sh", b"#!/bin/sh\n", 0o4755)
        _sym(tar, f"{PAYLOAD}/link", "sub/run.sh")
        _hard(tar, f"{PAYLOAD}/hard", f"{PAYLOAD}/sub/run.sh")
        _dir(tar, f"{PAYLOAD}/ro", 0o555)
        _file(tar, f"{PAYLOAD}/ro/inside", b"x")
    yield _tar(build)


def test_a_plain_tree_comes_out_whole(good_tree: bytes, dest: Path) -> None:
    hostfs.extract(io.BytesIO(good_tree), dest, rules.Policy("copy_out", prefix=PAYLOAD))
    out = dest / PAYLOAD
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "sub" / "run.sh").stat().st_mode) == 0o755  # setuid stripped
    assert os.readlink(out / "link") == "sub/run.sh"
    assert (out / "hard").stat().st_ino == (out / "sub" / "run.sh").stat().st_ino
    assert (out / "ro" / "inside").read_bytes() == b"x"
    assert stat.S_IMODE((out / "ro").stat().st_mode) == 0o755  # the owner may always clean it
    (out / "ro").chmod(0o755)


def test_layers_keep_whiteouts_and_in_tree_links(dest: Path) -> None:
    def lower(tar: tarfile.TarFile) -> None:
        _dir(tar, "usr/lib")
        _sym(tar, "lib", "usr/lib")
        _file(tar, "usr/lib/old", b"old")
        _dir(tar, "etc")
        _file(tar, "etc/a", b"a")
        _file(tar, "etc/b", b"b")

    def upper(tar: tarfile.TarFile) -> None:
        _file(tar, "lib/added", b"new")  # through /lib -> usr/lib, inside the tree
        _file(tar, "usr/lib/.wh.old", b"")
        _dir(tar, "etc")
        _file(tar, "etc/.wh..wh..opq", b"")
        _file(tar, "etc/c", b"c")
    apply_layer(io.BytesIO(_tar(lower)), dest, squash_owner=True)
    apply_layer(io.BytesIO(_tar(upper)), dest, squash_owner=True)
    assert (dest / "usr/lib/added").read_bytes() == b"new"
    assert not (dest / "usr/lib/old").exists()
    assert sorted(p.name for p in (dest / "etc").iterdir()) == ["c"]


@pytest.mark.parametrize("kind", [tarfile.REGTYPE, tarfile.DIRTYPE])
def test_an_absurd_member_is_a_clear_refusal(dest: Path, kind: bytes) -> None:
    # A directory's mtime is applied last, once the tree is complete: the same refusal then.
    def build(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(f"{PAYLOAD}/old")
        info.type, info.mtime = kind, 10 ** 30
        tar.addfile(info, io.BytesIO(b""))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        build(tar)
    with pytest.raises(UnsafeArchive, match=r"cannot (unpack 'payload/old'|finish unpacking)"):
        hostfs.extract(io.BytesIO(buffer.getvalue()), dest, rules.Policy("copy_out", prefix=PAYLOAD))


# ------------------------------------------------------------------ the parser (tarstream) on its own terms


def test_names_relative_to_the_tree_land_under_the_prefix(dest: Path, canary: Canary, tmp_path: Path) -> None:
    """A guest's own tar names members "./sub/file": they go under the prefix, by the same rules."""
    def build(tar: tarfile.TarFile) -> None:
        _dir(tar, ".", 0o750)
        _file(tar, "./sub/f", b"data")
        _sym(tar, "./link", "sub/f")
        _hard(tar, "./hard", "./sub/f")
    hostfs.extract(io.BytesIO(_tar(build)), dest, rules.Policy("copy_out", prefix=PAYLOAD))
    out = dest / PAYLOAD
    assert (out / "sub" / "f").read_bytes() == b"data" and os.readlink(out / "link") == "sub/f"
    assert (out / "hard").stat().st_ino == (out / "sub" / "f").stat().st_ino
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    before = _outside(tmp_path, dest)
    for name, target in (("./../x", None), ("./up", "../x"), ("./abs", str(canary.dir))):
        data = _tar(lambda tar, n=name, t=target: _sym(tar, n, t) if t else _file(tar, n))  # type: ignore[misc]
        with pytest.raises(UnsafeArchive, match="refused"):
            hostfs.extract(io.BytesIO(data), dest, rules.Policy("copy_out", prefix=PAYLOAD))
    canary.assert_untouched()
    assert _outside(tmp_path, dest) == before


def _header(name: bytes, size: int, typeflag: bytes = b"0", raw_size: bytes | None = None) -> bytes:
    """A GNU header built by hand, for fields tarfile will not write."""
    block = bytearray(512)
    block[0:len(name)] = name
    block[100:108] = b"0000644\0"
    block[124:136] = raw_size if raw_size is not None else b"%011o\0" % size
    block[136:148] = b"00000000000\0"
    block[156:157] = typeflag
    block[257:265] = b"ustar  \0"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


@pytest.mark.parametrize("case", ["huge-pax-header", "negative-size", "bad-checksum", "truncated", "unknown-type"])
def test_malformed_streams_are_refused_before_anything_is_held(case: str, dest: Path) -> None:
    """Metadata is held in memory: a 1 GiB pax header is refused from its header, not read."""
    if case == "huge-pax-header":
        data = _header(b"././@PaxHeader", 1 << 30, b"x")  # nothing follows: it is never read
    elif case == "negative-size":
        data = _header(f"{PAYLOAD}/f".encode(), 0, raw_size=b"\xff" + b"\xff" * 11)
    elif case == "bad-checksum":
        block = bytearray(_header(f"{PAYLOAD}/f".encode(), 0))
        block[0] ^= 1
        data = bytes(block)
    elif case == "truncated":
        data = _header(f"{PAYLOAD}/f".encode(), 4096) + b"x" * 100
    else:
        data = _header(f"{PAYLOAD}/f".encode(), 0, b"V")
    with pytest.raises(UnsafeArchive, match="not a readable tar stream"):
        hostfs.extract(io.BytesIO(data + bytes(1024)), dest, rules.Policy("copy_out", prefix=PAYLOAD))


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar to write sparse members")
@pytest.mark.parametrize("fmt", [["--format=gnu"], ["--format=posix", "--sparse-version=0.0"],
                                 ["--format=posix", "--sparse-version=0.1"],
                                 ["--format=posix", "--sparse-version=1.0"]],
                         ids=["gnu", "pax-0.0", "pax-0.1", "pax-1.0"])
def test_sparse_members_of_every_format_come_out_whole(fmt: list[str], tmp_path: Path, dest: Path) -> None:
    src = tmp_path / "src" / PAYLOAD
    src.mkdir(parents=True)
    with open(src / "holes", "wb") as f:
        for offset in (0, 3 << 20, 9 << 20):
            f.seek(offset)
            f.write(os.urandom(5000))
        f.truncate(12 << 20)
    archive = subprocess.run(["tar", "--sparse", *fmt, "-c", "-f", "-", "-C", str(src.parent), PAYLOAD],
                             capture_output=True, check=True, timeout=60).stdout
    assert len(archive) < 1 << 20
    hostfs.extract(io.BytesIO(archive), dest, rules.Policy("copy_out", prefix=PAYLOAD))
    assert (dest / PAYLOAD / "holes").read_bytes() == (src / "holes").read_bytes()
    capped = tmp_path / "capped"
    capped.mkdir()
    with pytest.raises(UnsafeArchive, match="the cap"):  # counted by its data, up front
        hostfs.extract(io.BytesIO(archive), capped, rules.Policy("copy_out", prefix=PAYLOAD),
                       rules.Caps(max_bytes=10_000))
    assert (capped / PAYLOAD / "holes").stat().st_size == 0


def test_extraction_works_with_descriptors_past_fd_setsize(dest: Path) -> None:
    """A worker with hundreds of guests in flight holds more than 1,024 descriptors: the confined
    extractor waited on its result pipe with select(), which raises ValueError past FD_SETSIZE."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} keeps descriptors under 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 4096, hard))
    held = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(1100)]  # the next ones are past 1024
    try:
        confined.extract(io.BytesIO(_tar(lambda tar: _file(tar, f"{PAYLOAD}/ok.txt", b"fine"))), dest,
                         rules.Policy("copy_out", prefix=PAYLOAD))
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert (dest / PAYLOAD / "ok.txt").read_bytes() == b"fine"
