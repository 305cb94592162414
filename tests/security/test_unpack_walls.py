"""Issue 23, host-side unpacking: links judged by resolution, guest exports normalised, metadata
and sparse data bounded, private cache and state dirs, and a safe ``copy_out(src, ".")``.

Hostile streams are built here (no guest needed) and, where the path a user takes matters,
sent through a real namespace guest. The "host" an attack aims at is a canary under this
test's tmp dir: harmless if the attack succeeds.
"""

from __future__ import annotations

import inspect
import io
import os
import stat
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm.baselines.archive import apply_layer
from pytest_smolvm.baselines.baseline import Baseline
from pytest_smolvm.errors import GuestError, UnsafeArchive
from pytest_smolvm.handle.aio import AsyncVM
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.host import paths
from pytest_smolvm.untrusted import hostfs, rules
from pytest_smolvm.untrusted.linkmap import LinkMap

PAYLOAD = "payload"


def _tar(*members: tuple[str, bytes, str, int], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    """(name, type, linkname or data, mode) members, in order."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for name, kind, extra, mode in members:
            info = tarfile.TarInfo(name)
            info.type, info.mode = kind, mode
            if kind == tarfile.REGTYPE:
                info.size = len(extra)
                tar.addfile(info, io.BytesIO(extra.encode()))
            else:
                info.linkname = extra
                tar.addfile(info)
    return buffer.getvalue()


def _copy(data: bytes, dest: Path, caps: rules.Caps | None = None) -> Path:
    hostfs.extract(io.BytesIO(data), dest, rules.Policy("copy_out", prefix=PAYLOAD), caps)
    return dest / PAYLOAD


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    host = tmp_path / "host"
    host.mkdir()
    (host / "passwd").write_text("host secret\n")
    return host


# The issue's shape: three ``d/up`` pairs spell six levels down and resolve to the tree's
# root, so the six ``..`` after them climb six levels above it while the spelling stays inside.
EVIL = "d/up/d/up/d/up/../../../../../../host/passwd"


def test_the_issue_repro_link_through_a_dotdot_link_is_refused(tmp_path: Path, canary: Path) -> None:
    dest = tmp_path / "1" / "2" / "3" / "4" / "dest"  # the tree's root, payload, is six below tmp_path
    dest.mkdir(parents=True)
    data = _tar((PAYLOAD, tarfile.DIRTYPE, "", 0o755), (f"{PAYLOAD}/d", tarfile.DIRTYPE, "", 0o755),
                (f"{PAYLOAD}/d/up", tarfile.SYMTYPE, "..", 0o777), (f"{PAYLOAD}/evil", tarfile.SYMTYPE, EVIL, 0o777))
    with pytest.raises(UnsafeArchive, match=r"evil.*resolves outside"):
        _copy(data, dest)


def test_a_link_made_later_cannot_turn_an_earlier_one_outward(tmp_path: Path, canary: Path) -> None:
    """``evil`` is checked against the finished tree: ``a/b/up`` only becomes ``-> ..`` after it."""
    dest = tmp_path / "dest"  # resolved, evil climbs from payload/a to tmp_path
    dest.mkdir()
    data = _tar((PAYLOAD, tarfile.DIRTYPE, "", 0o755), (f"{PAYLOAD}/a/b", tarfile.DIRTYPE, "", 0o755),
                (f"{PAYLOAD}/evil", tarfile.SYMTYPE, "a/b/up/../../../host/passwd", 0o777),
                (f"{PAYLOAD}/a/b/up", tarfile.SYMTYPE, "..", 0o777))
    with pytest.raises(UnsafeArchive, match=r"evil.*resolves outside"):
        _copy(data, dest)


def test_links_that_resolve_inside_still_come_out(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    out = _copy(_tar((PAYLOAD, tarfile.DIRTYPE, "", 0o755), (f"{PAYLOAD}/d/f", tarfile.REGTYPE, "in", 0o644),
                     (f"{PAYLOAD}/d/up", tarfile.SYMTYPE, "..", 0o777),
                     (f"{PAYLOAD}/ok", tarfile.SYMTYPE, "d/up/d/up/d/f", 0o777),
                     (f"{PAYLOAD}/dangling", tarfile.SYMTYPE, "d/missing/x", 0o777)), dest)
    assert (out / "ok").read_text() == "in"
    assert os.readlink(out / "dangling") == "d/missing/x"


def test_copy_out_of_the_issue_repro_tree_reads_no_host_file(vm: VM, tmp_path: Path, canary: Path) -> None:
    parent = tmp_path / "1" / "2" / "3" / "4"  # copy_out's staging tree root is six below tmp_path
    parent.mkdir(parents=True)
    vm.exec(f"mkdir -p /t/d && ln -s .. /t/d/up && ln -s {EVIL} /t/evil", check=True)
    with pytest.raises(GuestError, match="resolves outside"):
        vm.copy_out("/t", parent / "out")
    assert list(parent.iterdir()) == []  # neither the copy nor its staging dir is left


# A copy whose top is a symlink is the link itself: after the move to dest its target is taken
# from dest's parent, so no target keeps it inside the copy. The staging name (``payload``) spelt
# into the target once passed a check by spelling and then named a sibling of dest.
TOP_LINK_TARGETS = ["payload/secret", "payload/.", "payload", "payload/x/..", "payload/payload", ".", "x",
                    "../payload"]


@pytest.mark.parametrize("target", TOP_LINK_TARGETS)
def test_a_copy_whose_top_is_a_link_is_refused_whatever_its_target(tmp_path: Path, target: str) -> None:
    dest = tmp_path / "staging"
    dest.mkdir()
    with pytest.raises(UnsafeArchive, match=r"'payload'.*leaves the copied tree"):
        _copy(_tar((PAYLOAD, tarfile.SYMTYPE, target, 0o777)), dest)
    assert not os.path.lexists(dest / PAYLOAD)


@pytest.mark.parametrize("target", ["payload/secret", "payload/.", "."])
def test_the_link_judge_refuses_a_copy_whose_top_is_a_link(target: str) -> None:
    """The judge on its own (not only the check when the link is written): a top that is a
    link is refused, never taken for "no tree to judge"."""
    links = LinkMap(PAYLOAD, 1000, "copy_out")
    links.symlink([PAYLOAD], target)
    with pytest.raises(UnsafeArchive, match=r"'payload'.*leaves the copied tree"):
        links.judge()


def test_a_link_that_climbs_out_and_back_in_by_the_staging_name_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "staging"
    dest.mkdir()
    for link, target in (("d/l", "../../payload/d/f"), ("d/l", "../../payload"), ("l", "../payload/d/f")):
        with pytest.raises(UnsafeArchive, match=r"leaves the copied tree|resolves outside"):
            _copy(_tar((PAYLOAD, tarfile.DIRTYPE, "", 0o755), (f"{PAYLOAD}/d/f", tarfile.REGTYPE, "in", 0o644),
                       (f"{PAYLOAD}/{link}", tarfile.SYMTYPE, target, 0o777)), dest)


def test_a_tree_with_its_own_dir_named_like_the_staging_name_still_comes_out(tmp_path: Path) -> None:
    dest = tmp_path / "staging"
    dest.mkdir()
    out = _copy(_tar((PAYLOAD, tarfile.DIRTYPE, "", 0o755), (f"{PAYLOAD}/payload/f", tarfile.REGTYPE, "in", 0o644),
                     (f"{PAYLOAD}/l", tarfile.SYMTYPE, "payload/f", 0o777),
                     (f"{PAYLOAD}/payload/self", tarfile.SYMTYPE, "../payload/f", 0o777)), dest)
    assert (out / "l").read_text() == "in" and (out / "payload" / "self").read_text() == "in"


@pytest.mark.parametrize("into_dir", [False, True], ids=["named", "into-existing-dir"])
def test_copy_out_of_a_guest_link_never_leaves_a_link_to_a_host_path(vm: VM, tmp_path: Path, into_dir: bool) -> None:
    """The audit's repro: a host dir named like the staging dir beside dest, with a canary in it.
    Accepted, ``result.txt -> payload/secret`` read the canary and ``outdir -> payload/.``
    took a write into the host dir."""
    host = tmp_path / PAYLOAD
    host.mkdir()
    (host / "secret").write_text("host secret\n")
    vm.exec("mkdir -p /w && ln -s payload/secret /w/result.txt && ln -s payload/. /w/outdir "
            "&& ln -s . /w/here", check=True)
    for name in ("result.txt", "outdir", "here"):
        with pytest.raises(GuestError, match="leaves the copied tree"):
            vm.copy_out(f"/w/{name}", tmp_path if into_dir else tmp_path / name)
        assert not os.path.lexists(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [PAYLOAD]  # no staging dir left either
    assert [p.name for p in host.iterdir()] == ["secret"] and (host / "secret").read_text() == "host secret\n"
    # A link inside a copied tree that stays inside still comes out as a link.
    vm.exec("mkdir -p /t && echo in > /t/f && ln -s f /t/l", check=True)
    out = vm.copy_out("/t", tmp_path / "t")
    assert os.readlink(out / "l") == "f" and (out / "l").read_text() == "in\n"


# ------------------------------------------------------------------ normalisation


def test_copy_out_directory_modes_are_masked_so_the_host_can_clean_them(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    out = _copy(_tar((PAYLOAD, tarfile.DIRTYPE, "", 0o755), (f"{PAYLOAD}/none", tarfile.DIRTYPE, "", 0o000),
                     (f"{PAYLOAD}/none/f", tarfile.REGTYPE, "x", 0o644),
                     (f"{PAYLOAD}/open", tarfile.DIRTYPE, "", 0o777)), dest)
    assert stat.S_IMODE((out / "none").stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "open").stat().st_mode) == 0o755


def test_a_warm_export_is_normalised(tmp_path: Path) -> None:
    """No setuid/setgid, no world-writable dir without the sticky bit, no devices; a sticky
    /tmp and ordinary modes stay as the guest left them."""
    dest = tmp_path / "rootfs"
    dest.mkdir()
    data = _tar(("bin", tarfile.DIRTYPE, "", 0o755), ("bin/sh", tarfile.REGTYPE, "sh", 0o4755),
                ("bin/wall", tarfile.REGTYPE, "w", 0o2755), ("tmp", tarfile.DIRTYPE, "", 0o1777),
                ("open", tarfile.DIRTYPE, "", 0o777), ("locked", tarfile.DIRTYPE, "", 0o000),
                ("dev", tarfile.DIRTYPE, "", 0o755), ("dev/sda", tarfile.BLKTYPE, "", 0o666))
    apply_layer(io.BytesIO(data), dest, squash_owner=False, what="warm baseline export", guest_export=True)
    modes = {p: stat.S_IMODE((dest / p).stat().st_mode) for p in ("bin/sh", "bin/wall", "tmp", "open", "locked")}
    assert modes == {"bin/sh": 0o755, "bin/wall": 0o755, "tmp": 0o1777, "open": 0o755, "locked": 0o700}
    assert not (dest / "dev" / "sda").exists()


def test_the_namespace_warm_baseline_keeps_no_setuid_file(warm_baseline: Callable[[str], Baseline]) -> None:
    """The issue's repro: a ``chmod 4755`` shell from the warm-up must not sit in the cache."""
    derived = warm_baseline(
        "cp /bin/busybox /suid-sh 2>/dev/null || cp /bin/sh /suid-sh; chmod 4755 /suid-sh && mkdir -m 777 /open")
    assert derived.path is not None
    root = Path(derived.path)
    assert stat.S_IMODE((root / "suid-sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "open").stat().st_mode) == 0o755


@pytest.mark.parametrize("which", ["cache", "state"])
def test_cache_and_state_dirs_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    monkeypatch.delenv("PYTEST_SMOLVM_CACHE_DIR", raising=False)
    monkeypatch.delenv("PYTEST_SMOLVM_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    get: Callable[[], Path] = paths.cache_dir if which == "cache" else paths.state_dir
    made = get()
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(0o755)  # made by an older version
    assert stat.S_IMODE(get().stat().st_mode) == 0o700
    explicit = tmp_path / "explicit" / which
    monkeypatch.setenv(f"PYTEST_SMOLVM_{which.upper()}_DIR", str(explicit))
    assert get() == explicit and stat.S_IMODE(explicit.stat().st_mode) == 0o700


# ------------------------------------------------------------------ bounds


def test_metadata_headers_before_one_member_are_bounded_in_total() -> None:
    """Each pax header alone is under the 1 MiB cap; together they must not be held."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(PAYLOAD)
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    raw = bytearray()
    for i in range(24):  # distinct keys: each header adds 512 KiB to what the parser holds
        value = "v" * (512 << 10)
        record = f"comment{i}={value}\n"
        length = len(record) + 8
        length = len(f"{length} {record}")
        body = f"{length} {record}".encode()
        header = tarfile.TarInfo("././@PaxHeader")
        header.type, header.size = tarfile.XHDTYPE, len(body)
        raw += header.tobuf(tarfile.USTAR_FORMAT) + body + bytes(-len(body) % 512)
    data = bytes(raw) + buffer.getvalue()
    dest = Path(os.environ.get("TMPDIR", "/tmp")) / f"pax-{uuid.uuid4().hex}"
    dest.mkdir()
    try:
        with pytest.raises(UnsafeArchive, match="before one member"):
            _copy(data, dest)
    finally:
        for p in sorted(dest.rglob("*"), reverse=True):
            p.rmdir()
        dest.rmdir()


class _ShortReads(io.RawIOBase):
    """A pipe's reads: each returns what is there, here at most 40 KiB, never a whole 64 KiB."""

    def __init__(self, data: bytes) -> None:
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), 40 << 10, len(self._data) - self._pos)
        buffer[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


@pytest.mark.parametrize("reads", ["whole", "short"])
def test_long_zero_runs_land_as_holes(tmp_path: Path, reads: str) -> None:
    """A guest file of zeros is free in the guest; the host must not pay blocks for it, however
    a pipe cuts it into reads (a truncated guest file comes as plain zeros, often in reads
    shorter than a hole's minimum: the run counts across reads)."""
    dest = tmp_path / "dest"
    dest.mkdir()
    zeros = 64 << 20
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo(f"{PAYLOAD}/zeros")
        info.size = 4 + zeros + 4
        tar.addfile(info, io.BytesIO(b"head" + bytes(zeros) + b"tail"))
    data = buffer.getvalue()
    # a raw stream, as an unbuffered pipe is: not an IO[bytes], though read() is all extract asks of it
    hostfs.extract(io.BytesIO(data) if reads == "whole" else _ShortReads(data), dest,  # type: ignore[arg-type]
                   rules.Policy("copy_out", prefix=PAYLOAD))
    st = (dest / PAYLOAD / "zeros").stat()
    assert st.st_size == zeros + 8
    assert st.st_blocks * 512 <= 4 << 20
    with open(dest / PAYLOAD / "zeros", "rb") as f:
        assert f.read(4) == b"head"
        f.seek(zeros)
        assert f.read() == bytes(4) + b"tail"


def test_copy_out_of_a_truncated_guest_file_costs_the_host_no_blocks(vm: VM, tmp_path: Path) -> None:
    """The independent attack set's case: ``truncate -s`` is free in the guest, and the guest's
    tar sends it as plain zeros through a pipe (short reads)."""
    vm.exec("mkdir -p /t && truncate -s 256M /t/sparse && echo end >> /t/sparse", check=True)
    out = vm.copy_out("/t", tmp_path / "out")
    st = (out / "sparse").stat()
    assert st.st_size == (256 << 20) + 4
    assert st.st_blocks * 512 <= 4 << 20


# ------------------------------------------------------------------ copy_out's destination


def test_copy_out_into_dot_puts_the_copy_inside_and_keeps_the_rest(vm: VM, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "mine.txt").write_text("keep me")
    monkeypatch.chdir(work)
    vm.exec("mkdir -p /t/sub && echo guest > /t/sub/f", check=True)
    out = vm.copy_out("/t", ".")
    assert out == Path("t") and (work / "t" / "sub" / "f").read_text() == "guest\n"
    assert (work / "mine.txt").read_text() == "keep me"
    again = vm.copy_out("/t/sub/f", work)  # an existing directory: the file goes inside it
    assert again == work / "f" and again.read_text() == "guest\n"
    assert sorted(p.name for p in work.iterdir()) == ["f", "mine.txt", "t"]  # no staging dir left


def test_async_copy_out_takes_the_same_limits() -> None:
    sync = inspect.signature(VM.copy_out).parameters
    aio = inspect.signature(AsyncVM.copy_out).parameters
    assert list(aio) == list(sync)
    assert all(aio[name].kind == sync[name].kind for name in ("max_bytes", "timeout"))


# ------------------------------------------------------------------ the confined helper on its own

_ESCAPE = """
import os, socket, sys
sys.path[:0] = sys.argv[1].split(":")
from pytest_smolvm.untrusted import confined
from pytest_smolvm.untrusted import rules
try:
    import pyseccomp
except ImportError:
    pyseccomp = None
fd = os.open(sys.argv[2], os.O_RDONLY | os.O_DIRECTORY)
confined.confine(fd, rules.Policy("test", prefix="payload"), rules.Caps(), pyseccomp)
found = []
for attempt, action in [
    ("read-host-file", lambda: open(sys.argv[3]).read()),
    ("climb-out", lambda: None if os.listdir("/../../..") == ["inside"] else os.listdir("/../../..")),
    ("exec", lambda: os.execv("/bin/sh", ["sh"])),
    ("socket", lambda: socket.socket()),
    ("fork", lambda: os.fork()),
    ("chroot", lambda: os.chroot("/")),
]:
    try:
        result = action()
        if result is not None:
            found.append(f"{attempt}: allowed {str(result)[:40]!r}")
    except OSError:
        pass
print("|".join(found) or "contained")
"""


def test_the_helper_reaches_nothing_but_its_destination(tmp_path: Path, canary: Path) -> None:
    """The first wall alone, as if the walker had let a link through: confined, the helper can
    read no host file, see no dir above its root, exec, fork, open sockets or chroot."""
    import subprocess
    import sys

    from pytest_smolvm.untrusted import confined

    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "inside").write_text("in")
    result = subprocess.run([sys.executable, "-I", "-S", "-c", _ESCAPE, confined._import_paths(), str(dest),
                             str(canary / "passwd")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "contained"


def test_collected_paths_nested_under_one_another_replace_not_nest(vm: VM, tmp_path: Path) -> None:
    """A child path collected after its parent (and the reverse) lands at its own name, never
    inside the earlier copy's tree; a link the guest put there is replaced, not followed."""
    import types

    from pytest_smolvm.plugin.artifacts import _copy_out

    vm.exec("mkdir -p /a/b && echo f > /a/b/f && ln -s b /a/link", check=True)
    live = types.SimpleNamespace(vm=vm)
    for order in (["/a", "/a/b", "/a/link"], ["/a/b", "/a"]):
        files = tmp_path / f"files-{len(order)}"
        notes: list[str] = []
        for path in order:
            _copy_out(live, path, files, 1 << 30, notes)  # type: ignore[arg-type]
        assert (files / "a" / "b" / "f").read_text() == "f\n"
        assert not (files / "a" / "b" / "b").exists()
        assert not (files / "a").is_symlink() and not (files / "a" / "b").is_symlink()
        assert [p.name for p in files.iterdir()] == ["a"]  # no staging copy left


# ------------------------------------------------------------------ the unpacker process's lifecycle

_USE_AND_WAIT = """
import io, os, sys, tarfile, tempfile, time
from pytest_smolvm.untrusted import confined, rules
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w") as tar:
    info = tarfile.TarInfo("payload/a"); info.size = 1; tar.addfile(info, io.BytesIO(b"x"))
confined.extract(io.BytesIO(buf.getvalue()), tempfile.mkdtemp(), rules.Policy("t", prefix="payload"))
print(confined._UNPACKER.process.pid, flush=True)
if sys.argv[1] == "wait":
    time.sleep(60)
"""


def _gone_within(pid: int, seconds: float) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["exits", "is SIGKILLed"])
def test_the_unpacker_never_outlives_its_process(how: str) -> None:
    """The unpacker forks a child per stream and lives only as long as the process that started
    it: when that process exits, or is killed without a chance to clean up, its socket closes
    and the unpacker exits too."""
    import signal
    import subprocess
    import sys

    user = subprocess.Popen([sys.executable, "-c", _USE_AND_WAIT, "wait" if how == "is SIGKILLed" else "exit"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert user.stdout is not None
        unpacker = int(user.stdout.readline())
        if how == "is SIGKILLed":
            user.send_signal(signal.SIGKILL)
        user.wait(timeout=30)
    finally:
        user.kill()
    assert _gone_within(unpacker, 10), f"the unpacker {unpacker} outlived its process"


def test_a_dead_unpacker_is_started_again(tmp_path: Path) -> None:
    from pytest_smolvm.untrusted import confined

    def one(dest: Path) -> None:
        dest.mkdir()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("payload/a")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        confined.extract(io.BytesIO(buf.getvalue()), dest, rules.Policy("t", prefix="payload"))
        assert (dest / "payload" / "a").read_bytes() == b"x"

    one(tmp_path / "first")
    process = confined._UNPACKER.process
    assert process is not None
    process.kill()
    process.wait(timeout=10)
    one(tmp_path / "second")  # the send fails on the dead one's socket, and a new one serves it
    assert confined._UNPACKER.process is not process
