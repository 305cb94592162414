"""The namespace guest's ``copy_in`` unpacker, run on its own (it is standard library only).

In a guest it runs as a request's child inside the guest's confinement; here it runs on a temp
dir, fed by the same producers ``copy_in`` uses (the host's GNU tar, ``tarfile``'s PAX) and by
``tarfile``'s other formats, so that every header form it reads is read at least once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import io
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_smolvm import limits
from pytest_smolvm.backends.base import Backend
from pytest_smolvm.backends.namespace import cgroups
from pytest_smolvm.backends.namespace.helper import stage, unpack
from pytest_smolvm.backends.namespace.helper.unpack import OPEN_LEVELS, Unpacker, _number
from pytest_smolvm.backends.namespace.helper.writers import POOLED_FILE_BYTES, writers_for
from pytest_smolvm.errors import GuestError
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.host.procs import wait_gone
from tests.backends.conftest import MakeGuest

GNU_TAR = shutil.which("tar")


def _tree(root: Path) -> dict[str, tuple[str, int, int, bytes | str]]:
    """Every entry under ``root``: kind, mode, mtime (s) and content or link target."""
    found: dict[str, tuple[str, int, int, bytes | str]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = str(path.relative_to(root))
        if stat.S_ISLNK(st.st_mode):
            found[rel] = ("link", 0, 0, os.readlink(path))
        elif stat.S_ISDIR(st.st_mode):
            found[rel] = ("dir", stat.S_IMODE(st.st_mode), int(st.st_mtime), b"")
        elif stat.S_ISFIFO(st.st_mode):
            found[rel] = ("fifo", stat.S_IMODE(st.st_mode), int(st.st_mtime), b"")
        else:
            found[rel] = ("file", stat.S_IMODE(st.st_mode), int(st.st_mtime), path.read_bytes())
    return found


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    deep = src / "a" / ("long-directory-name-" * 6) / "b"
    deep.mkdir(parents=True)
    (deep / ("long-file-name-" * 6)).write_bytes(b"far down\n")
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    (src / "setuid").write_bytes(b"s")
    (src / "setuid").chmod(0o4750)
    (src / "empty").write_bytes(b"")
    (src / "big").write_bytes(os.urandom(3 << 20))  # more than one read
    (src / "link").symlink_to("run.sh")
    (src / "dangling").symlink_to("/nowhere/at/all")
    os.link(src / "run.sh", src / "hard")
    os.mkfifo(src / "fifo", 0o640)
    (src / "ro").mkdir()
    (src / "ro" / "inside").write_text("in a read-only dir\n")
    (src / "ro").chmod(0o555)  # set once the stream has left it, or "inside" could not be made
    for i, path in enumerate(sorted(src.rglob("*"), reverse=True)):  # children before parents
        os.utime(path, (1_600_000_000 + i, 1_600_000_000 + i), follow_symlinks=False)
    return src


def _gnu_tar(src: Path) -> bytes:
    assert GNU_TAR is not None
    return subprocess.run([GNU_TAR, "-c", "-f", "-", "--format=gnu", "--numeric-owner", "-C", str(src), "."],
                          check=True, capture_output=True).stdout


def _tarfile(src: Path, fmt: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        tar.add(src, arcname=".")
    return out.getvalue()


def _unpack(data: bytes, dest: Path, writers: int = 1) -> None:
    dest.mkdir(exist_ok=True)
    Unpacker(str(dest), io.BytesIO(data).read, writers=writers).run()


@pytest.fixture
def writers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """1: every file made in-process; 2: writer processes from the first small file on."""
    count: int = getattr(request, "param", 1)
    monkeypatch.setattr(unpack, "WRITERS_AFTER", 0)
    return count


def _children() -> set[int]:
    """This process's children, every thread's."""
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        found.update(int(pid) for pid in (task / "children").read_text().split())
    return found


@pytest.mark.parametrize("writers", [1, 2], indirect=True)
@pytest.mark.parametrize("producer", ["gnu-tar", "tarfile-pax", "tarfile-gnu", "tarfile-ustar"])
def test_every_producer_round_trips(tmp_path: Path, producer: str, writers: int) -> None:
    src = _source(tmp_path)
    if producer == "gnu-tar":
        if GNU_TAR is None:
            pytest.skip("no tar on this host")
        data = _gnu_tar(src)
    else:
        fmt = {"tarfile-pax": tarfile.PAX_FORMAT, "tarfile-gnu": tarfile.GNU_FORMAT,
               "tarfile-ustar": tarfile.USTAR_FORMAT}[producer]
        data = _tarfile(src, fmt)
    dest = tmp_path / "dest"
    _unpack(data, dest, writers)
    assert _tree(dest) == _tree(src)
    assert os.stat(dest / "hard").st_ino == os.stat(dest / "run.sh").st_ino
    assert stat.S_IMODE(dest.stat().st_mode) == stat.S_IMODE(src.stat().st_mode)  # "." onto dest


def test_a_chain_deeper_than_the_open_fd_bound_unpacks_under_a_low_fd_limit(tmp_path: Path) -> None:
    """Directories are held open only OPEN_LEVELS deep; deeper ones are reopened when needed."""
    src = tmp_path / "src"
    depth, fd_limit = 600, 320
    assert OPEN_LEVELS + 32 < fd_limit < depth
    bottom = src.joinpath(*["d"] * depth)
    subprocess.run(["mkdir", "-p", str(bottom)], check=True)
    (bottom / "f").write_text("bottom\n")
    middle = src.joinpath(*["d"] * (depth // 2))
    (middle / "beside").write_text("middle\n")  # after the bottom: a level whose fd was closed
    os.chmod(middle, 0o700)
    archive = tmp_path / "chain.tar"
    archive.write_bytes(_tarfile(src, tarfile.GNU_FORMAT))
    dest = tmp_path / "dest"
    dest.mkdir()
    script = textwrap.dedent(f"""
        import resource, sys
        from pytest_smolvm.backends.namespace.helper.unpack import Unpacker
        resource.setrlimit(resource.RLIMIT_NOFILE, ({fd_limit}, {fd_limit}))
        with open({str(archive)!r}, "rb") as f:
            Unpacker({str(dest)!r}, f.read).run()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert dest.joinpath(*["d"] * depth, "f").read_text() == "bottom\n"
    assert dest.joinpath(*["d"] * (depth // 2), "beside").read_text() == "middle\n"
    assert stat.S_IMODE(dest.joinpath(*["d"] * (depth // 2)).stat().st_mode) == 0o700


def test_what_is_already_there_is_replaced_never_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("untouched\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "f").symlink_to(outside)  # a file member lands on a link: the link goes
    (dest / "g").write_text("old\n")
    os.link(dest / "g", tmp_path / "g-elsewhere")  # replaced, so another name for it keeps the old bytes
    (dest / "d").symlink_to(elsewhere)  # a directory member lands on a link to one: kept, as tar does
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "inner").write_text("through the link\n")
    (src / "f").write_text("new f\n")
    (src / "g").write_text("new g\n")
    _unpack(_gnu_tar(src) if GNU_TAR else _tarfile(src, tarfile.PAX_FORMAT), dest)
    assert outside.read_text() == "untouched\n"
    assert not (dest / "f").is_symlink() and (dest / "f").read_text() == "new f\n"
    assert (tmp_path / "g-elsewhere").read_text() == "old\n" and (dest / "g").read_text() == "new g\n"
    assert (elsewhere / "inner").read_text() == "through the link\n"


@pytest.mark.parametrize("writers", [1, 2], indirect=True)
def test_a_file_over_a_directory_names_the_full_path(tmp_path: Path, writers: int) -> None:
    dest = tmp_path / "dest"
    (dest / "sub" / "x").mkdir(parents=True)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for name in ("a", "x", "z"):
        (src / "sub" / name).write_text("a file\n")
    before = _children()
    with pytest.raises(IsADirectoryError) as refused:
        _unpack(_tarfile(src, tarfile.PAX_FORMAT), dest, writers)
    assert refused.value.filename == str(dest / "sub" / "x")
    assert _children() - before == set()  # the writers are gone with the error


def test_a_truncated_stream_and_a_dotdot_name_are_errors(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(10_000))
    whole = _tarfile(src, tarfile.PAX_FORMAT)
    with pytest.raises(OSError, match="ended in the middle") as truncated:
        _unpack(whole[:len(whole) // 2], tmp_path / "half")
    assert truncated.value.filename == str(tmp_path / "half" / "f")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("../escape")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(OSError, match=r"'\.\.'"):
        _unpack(out.getvalue(), tmp_path / "dotdot")
    assert not (tmp_path / "escape").exists()


def test_numbers_in_octal_and_base_256() -> None:
    assert _number(b"0000644\0") == 0o644
    assert _number(b" 644 \0\0\0") == 0o644
    assert _number(b"\0" * 8) == 0
    assert _number(b"\x80" + (8 << 30).to_bytes(11, "big")) == 8 << 30
    with pytest.raises(OSError, match="bad number"):
        _number(b"12x4\0")



def _many_small_files(src: Path) -> None:
    """40 directories of 30 small files each: modes, mtimes and directory modes that vary."""
    for d in range(40):
        directory = src / f"d{d:02d}"
        directory.mkdir(parents=True)
        for f in range(30):
            path = directory / f"f{f:02d}"
            path.write_bytes(os.urandom(f * 37))
            path.chmod((0o644, 0o600, 0o755, 0o4750)[f % 4])
            os.utime(path, (1_500_000_000 + f, 1_500_000_000 + d * 100 + f))
        os.utime(directory, (1_600_000_000 + d, 1_600_000_000 + d))
        if d % 5 == 0:
            directory.chmod(0o555)  # set once its files are made, by the writer that made them


def test_small_files_are_made_by_writer_processes_as_archived(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    _many_small_files(src)
    data = _gnu_tar(src) if GNU_TAR else _tarfile(src, tarfile.PAX_FORMAT)
    stream = io.BytesIO(data)
    before = _children()
    in_flight: list[set[int]] = []

    def read(size: int) -> bytes:
        if not in_flight and stream.tell() > len(data) // 2:
            in_flight.append(_children() - before)
        return stream.read(size)

    dest = tmp_path / "dest"
    dest.mkdir()
    Unpacker(str(dest), read, writers=2).run()
    assert len(in_flight[0]) == 2, f"writer processes halfway through the stream: {in_flight[0]}"
    assert _children() - before == set()
    try:
        assert _tree(dest) == _tree(src)
    finally:
        for path in (src, dest):
            subprocess.run(["chmod", "-R", "u+w", str(path)], check=True)


def _member(tar: tarfile.TarFile, name: str, data: bytes = b"", *, kind: bytes = tarfile.REGTYPE,
            link: str = "", mode: int = 0o644, mtime: int = 1_600_000_000) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime, info.size = kind, link, mode, mtime, len(data)
    tar.addfile(info, io.BytesIO(data) if data else None)


@pytest.mark.parametrize("writers", [2], indirect=True)
def test_writers_keep_the_streams_order_where_it_matters(tmp_path: Path, writers: int) -> None:
    """Names written twice, a link to a file a writer has in hand, a directory revisited, a
    large file beside small ones: each lands as the stream says, as it does made in-process."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _member(tar, "d", kind=tarfile.DIRTYPE, mode=0o750, mtime=1_400_000_000)
        _member(tar, "d/x", b"first")
        _member(tar, "d/x", b"second")  # the same batch
        _member(tar, "d/y", b"a file, then a link")
        _member(tar, "d/y", kind=tarfile.SYMTYPE, link="x")  # made by the parser, after the file
        _member(tar, "d/z", kind=tarfile.SYMTYPE, link="x")
        _member(tar, "d/z", b"a link, then a file")  # made by a writer, after the link
        _member(tar, "d/h", kind=tarfile.LNKTYPE, link="d/x")  # a hard link to what a writer makes
        _member(tar, "d/big", b"small first")
        _member(tar, "d/big", b"B" * (POOLED_FILE_BYTES + 1))  # made by the parser, after the writer's
        _member(tar, "e", kind=tarfile.DIRTYPE)
        _member(tar, "e/f", b"elsewhere")
        _member(tar, "d/x", b"third")  # d again: its writer replaces d/x; d/h keeps "second"
        _member(tar, "f", b"top")
        _member(tar, "f/inside", b"a file, then a directory of the same name")
    data = out.getvalue()
    made = tmp_path / "writers"
    with pytest.raises(NotADirectoryError) as refused:  # "f" is a file: the last member cannot go under it
        _unpack(data, made, writers)
    assert refused.value.filename == str(made / "f" / "inside")
    alone = tmp_path / "in-process"
    with pytest.raises(NotADirectoryError):
        _unpack(data, alone, 1)
    trees = _tree(made), _tree(alone)
    for tree in trees:  # "d" is written into after the stream left it, so its mtime is that moment's:
        kind, mode, _, content = tree["d"]  # two unpacks a second apart differ there (CI saw it)
        tree["d"] = (kind, mode, 0, content)
    assert trees[0] == trees[1]
    assert (made / "d" / "x").read_bytes() == b"third"
    assert (made / "d" / "h").read_bytes() == b"second"
    assert os.readlink(made / "d" / "y") == "x"
    assert (made / "d" / "z").read_bytes() == b"a link, then a file"
    assert (made / "d" / "big").stat().st_size == POOLED_FILE_BYTES + 1


def test_writers_outlive_no_parser_killed_alone(tmp_path: Path) -> None:
    """The host kills a request's whole process group; a parser killed alone (the OOM killer)
    still takes its writers with it: they read the end of their socket and exit."""
    src = tmp_path / "src"
    _many_small_files(src)
    data = _tarfile(src, tarfile.PAX_FORMAT)
    dest = tmp_path / "dest"
    dest.mkdir()
    script = textwrap.dedent(f"""
        import sys
        from pytest_smolvm.backends.namespace.helper import unpack
        unpack.WRITERS_AFTER = 0
        unpack.Unpacker({str(dest)!r}, sys.stdin.buffer.read, writers=2).run()
    """)
    parser = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    children: list[int] = []
    try:
        assert parser.stdin is not None
        parser.stdin.write(data[:len(data) // 2])  # the rest never comes: the parser waits for it
        parser.stdin.flush()
        deadline = time.monotonic() + 30
        while len(children) < 2 and time.monotonic() < deadline:
            children = [int(pid) for pid in Path(f"/proc/{parser.pid}/task/{parser.pid}/children").read_text().split()]
            time.sleep(0.02)
        assert len(children) == 2, children
        os.kill(parser.pid, signal.SIGKILL)
        parser.wait(timeout=10)
        for pid in children:
            assert wait_gone(pid, 10), f"writer {pid} outlived its parser"
    finally:
        parser.kill()
        parser.wait()
        for pid in children:  # a writer that failed the test: not left spinning
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=True)


def test_no_process_to_spare_makes_every_file_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest at its pids limit: the second writer cannot be forked. The first is reaped, and
    the copy goes on without them."""
    src = tmp_path / "src"
    _many_small_files(src)
    real_fork, forks = os.fork, []

    def fork() -> int:
        forks.append(1)
        if len(forks) > 1:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real_fork()

    monkeypatch.setattr(unpack, "WRITERS_AFTER", 0)
    monkeypatch.setattr(os, "fork", fork)
    before = _children()
    dest = tmp_path / "dest"
    try:
        _unpack(_tarfile(src, tarfile.PAX_FORMAT), dest, 2)
        assert len(forks) == 2 and _children() - before == set()
        assert _tree(dest) == _tree(src)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=True)


def test_a_writer_killed_mid_stream_fails_the_copy_cleanly(tmp_path: Path, writers: int) -> None:
    """The OOM killer takes a writer: the copy fails with an error that says so, never hangs,
    and the other writer is reaped."""
    src = tmp_path / "src"
    _many_small_files(src)
    data = _tarfile(src, tarfile.PAX_FORMAT)
    stream = io.BytesIO(data)
    before = _children()
    killed: list[int] = []

    def read(size: int) -> bytes:
        if not killed and stream.tell() > len(data) // 3 and len(_children() - before) == 2:
            killed.append(min(_children() - before))
            os.kill(killed[0], signal.SIGKILL)
        return stream.read(size)

    dest = tmp_path / "dest"
    dest.mkdir()
    try:
        with pytest.raises(OSError, match="a writer process died") as failed:
            Unpacker(str(dest), read, writers=2).run()
        assert failed.value.errno == errno.EIO and killed
        assert _children() - before == set()
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=True)


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    queue = [pid]
    while queue:
        try:
            children = Path(f"/proc/{queue.pop()}/task").glob("*/children")
            for task in children:
                pids = [int(child) for child in task.read_text().split()]
                found.update(pids)
                queue.extend(pids)
        except OSError:
            continue  # gone meanwhile
    return found


@pytest.mark.parametrize("backend", ["namespace"], indirect=True)
def test_a_guests_copy_in_starts_as_many_writers_as_its_cpus(make_guest: MakeGuest, backend: Backend,
                                                              tmp_path: Path) -> None:
    """The host tells the guest's unpacker how many writers its CPUs allow: two by default,
    none for a guest given one CPU. Seen from the host, as processes under the guest's init."""
    src = tmp_path / "src"
    for d in range(40):
        (src / f"d{d:02d}").mkdir(parents=True)
        for f in range(100):
            (src / f"d{d:02d}" / f"f{f:03d}").write_bytes(b"x" * 100)
    allowed = cgroups.cpus_allowed(backend.limits, None)  # type: ignore[attr-defined]
    for cpus, writers in ((None, writers_for(allowed)), (1, 1)):
        vm, guest = make_guest(**({} if cpus is None else {"cpus": cpus}))
        most = _most_processes_under(guest.pid, functools.partial(vm.copy_in, src, "/work/tree"))  # type: ignore[attr-defined]
        assert most == 1 + (writers if writers > 1 else 0), (cpus, most)  # the request's child and its writers
        assert vm.exec("find /work/tree -type f | wc -l").stdout.strip() == "4000"


def _most_processes_under(pid: int, action: Callable[[], object]) -> int:
    """The most processes seen under ``pid`` while ``action`` ran, beyond those there before."""
    before = len(_descendants(pid))
    most, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            most[0] = max(most[0], len(_descendants(pid)) - before)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        action()
    finally:
        done.set()
        watcher.join()
    return most[0]


def _small_files(root: Path, count: int, prefix: str = "f") -> Path:
    for i in range(count):
        folder = root / f"d{i // 100:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{prefix}{i:05d}").write_bytes(b"x" * 100)
    return root


def _staged_left(vm: VM) -> list[str]:
    return [name for name in vm.exec("ls -A /").stdout.split() if name.startswith(stage.STAGE_PREFIX)]


@pytest.mark.parametrize("backend", ["namespace"], indirect=True)
def test_a_copy_to_a_new_directory_that_fails_leaves_nothing(make_guest: MakeGuest, tmp_path: Path) -> None:
    """A tree copied to a directory that does not exist yet is unpacked aside in the guest's
    upper layer and moved in whole (helper/stage.py ``open_stage``). One that fails on the way,
    here on a full disk, leaves no part of itself at dest, and the aside is gone too."""
    src = _small_files(tmp_path / "src", 300)
    (src / "big").write_bytes(b"\0" * (24 << 20))  # more than the guest's whole disk
    vm, _ = make_guest(disk_mb=16)
    vm.exec("mkdir /work")  # dest's parent: made for the copy, and kept, as mkdir -p keeps it
    used_before = int(vm.exec("df -k / | tail -1 | awk '{print $3}'").stdout)
    with pytest.raises(OSError) as failed:
        vm.copy_in(src, "/work/tree")
    assert failed.value.errno == errno.ENOSPC, failed.value
    assert vm.exec("test -e /work/tree").exit_code == 1, "a part of the failed copy is at its dest"
    assert _staged_left(vm) == []
    # Nothing of it anywhere else on the disk either (the 300 files alone would be 1.2 MiB).
    assert int(vm.exec("df -k / | tail -1 | awk '{print $3}'").stdout) - used_before <= 16
    vm.copy_in(src / "d000", "/work/tree")  # and the guest copies on
    assert vm.exec("ls /work/tree | wc -l").stdout.strip() == "100"


@pytest.mark.parametrize("backend", ["namespace"], indirect=True)
def test_a_copy_killed_on_the_way_leaves_nothing(make_guest: MakeGuest, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An unpacker the host kills (its file op timed out: here a guest process stopped it)
    cannot clean up after itself; the host's follow-up removes what it had staged."""
    src = _small_files(tmp_path / "src", 20_000)
    vm, _ = make_guest()
    # Stops every process but the init and itself once a stage appears: the unpacker and its writers.
    vm.write_file("/stopper.sh", textwrap.dedent(f"""\
        while :; do
            for d in /{stage.STAGE_PREFIX}*; do [ -d "$d" ] && break 2; done
        done
        for p in /proc/[0-9]*; do
            pid=${{p#/proc/}}
            [ "$pid" = 1 ] || [ "$pid" = $$ ] || kill -STOP "$pid" 2>/dev/null
        done
        touch /stopped
        """).encode())
    vm.exec("setsid sh /stopper.sh </dev/null >/dev/null 2>&1 &")
    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, guest_file_op=3.0))
    with pytest.raises(GuestError, match="took longer than 3s"):
        vm.copy_in(src, "/work/tree")
    assert vm.exec("test -e /stopped").exit_code == 0  # the stop came while the copy was staged
    assert vm.exec("test -e /work/tree").exit_code == 1
    assert _staged_left(vm) == []


@pytest.mark.parametrize("backend", ["namespace"], indirect=True)
def test_a_copy_where_a_baseline_directory_was_removed_shows_the_copy_alone(make_guest: MakeGuest,
                                                                            tmp_path: Path) -> None:
    """Moved in over what the guest removed from its baseline (a whiteout in the upper layer),
    the staged tree hides the baseline's directory of that name, as a directory made there would."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "mine").write_text("copied\n")
    vm, _ = make_guest()
    assert vm.exec("ls /etc/periodic").stdout.split()  # the baseline's
    vm.exec("rm -rf /etc/periodic")
    vm.copy_in(src, "/etc/periodic")
    assert vm.exec("ls -A /etc/periodic").stdout.split() == ["mine"]
    assert vm.exec("cat /etc/periodic/mine").stdout == "copied\n"


@pytest.mark.parametrize("backend", ["namespace"], indirect=True)
def test_copies_to_one_new_directory_at_once_land_together(make_guest: MakeGuest, tmp_path: Path) -> None:
    """Two copies to a directory neither found there: the second to finish moves its tree into
    the first's (``stage.merge``), as two unpacks into one directory would have left them."""
    first = _small_files(tmp_path / "first", 3_000, prefix="a")
    second = _small_files(tmp_path / "second", 3_000, prefix="b")
    vm, _ = make_guest()
    errors: list[BaseException] = []

    def copy(src: Path) -> None:
        try:
            vm.copy_in(src, "/work/tree")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=copy, args=(src,)) for src in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert vm.exec("find /work/tree -type f | wc -l").stdout.strip() == "6000"
    assert vm.exec("ls /work/tree/d000 | wc -l").stdout.strip() == "200"
    assert _staged_left(vm) == []


@pytest.mark.parametrize("backend", ["namespace"], indirect=True)
@pytest.mark.parametrize("made", ["directory", "file"])
def test_what_a_guest_makes_at_dest_while_the_tree_is_staged(make_guest: MakeGuest, tmp_path: Path,
                                                              made: str) -> None:
    """A guest process makes ``dest`` once the copy's stage appears: a directory, and the tree
    is merged into it (what the guest put there kept); a file, and the copy fails naming
    ``dest`` (not the stage, a name the user never gave) and leaves the guest's file alone."""
    src = _small_files(tmp_path / "src", 20_000)
    vm, _ = make_guest()
    vm.exec("mkdir /work")
    make = "mkdir /work/tree && echo guest > /work/tree/own" if made == "directory" else "echo guest > /work/tree"
    vm.write_file("/maker.sh", textwrap.dedent(f"""\
        while :; do
            for d in /{stage.STAGE_PREFIX}*; do [ -d "$d" ] && break 2; done
        done
        {make}
        """).encode())
    vm.exec("setsid sh /maker.sh </dev/null >/dev/null 2>&1 &")
    if made == "directory":
        vm.copy_in(src, "/work/tree")
        assert vm.exec("cat /work/tree/own").stdout == "guest\n"
        assert vm.exec("find /work/tree -type f | wc -l").stdout.strip() == "20001"
    else:
        with pytest.raises(NotADirectoryError) as failed:
            vm.copy_in(src, "/work/tree")
        assert failed.value.filename == "/work/tree"
        assert vm.exec("cat /work/tree").stdout == "guest\n"
    assert _staged_left(vm) == []


@pytest.mark.parametrize("backend", ["namespace"], indirect=True)
def test_a_new_dest_the_stage_cannot_serve_is_made_in_place(make_guest: MakeGuest, tmp_path: Path) -> None:
    """Under another mount (a move from the upper layer would cross filesystems) and under a
    setgid directory (what is made there takes its group), a new tree is unpacked in place, as
    before the stage: it lands, with the group a directory made there gets."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("copied\n")
    vm, _ = make_guest()
    vm.copy_in(src, "/dev/shm/tree")
    assert vm.exec("cat /dev/shm/tree/f").stdout == "copied\n"
    vm.exec("mkdir -m 2775 /shared && chgrp 1234 /shared", check=True)
    vm.copy_in(src, "/shared/tree")
    assert vm.exec("stat -c %g /shared/tree /shared/tree/f").stdout.split() == ["1234", "1234"]
    assert _staged_left(vm) == []


def test_a_staged_tree_merges_into_a_directory_made_meanwhile_by_the_unpackers_rules(tmp_path: Path) -> None:
    """``stage.merge`` on its own: a file or link replaces what is there, a directory merges into
    one there (or into a link to one) and gives it its mode and mtime; a file over a directory
    is an error naming it."""
    from pytest_smolvm.backends.namespace.helper.stage import merge

    staged, dest, elsewhere = tmp_path / "staged", tmp_path / "dest", tmp_path / "elsewhere"
    for root in (staged / "sub" / "deeper", dest / "sub", elsewhere):
        root.mkdir(parents=True)
    (staged / "file").write_text("new")
    (dest / "file").write_text("old")
    (staged / "sub" / "deeper" / "inner").write_text("staged")
    (dest / "sub" / "kept").write_text("there before")
    (staged / "sub").chmod(0o750)
    os.utime(staged / "sub", ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    (staged / "linked").mkdir()
    (staged / "linked" / "through").write_text("into the link's directory")
    (dest / "linked").symlink_to(elsewhere)

    merge(str(staged), str(dest), (0o711, 1_500_000_000_000_000_000))

    assert (dest / "file").read_text() == "new"
    assert (dest / "sub" / "kept").read_text() == "there before"
    assert (dest / "sub" / "deeper" / "inner").read_text() == "staged"
    assert stat.S_IMODE((dest / "sub").stat().st_mode) == 0o750
    assert (dest / "sub").stat().st_mtime_ns == 1_600_000_000_000_000_000
    assert (dest / "linked").is_symlink() and (elsewhere / "through").read_text() == "into the link's directory"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o711 and dest.stat().st_mtime_ns == 1_500_000_000_000_000_000

    (staged / "sub").mkdir(parents=True, exist_ok=True)
    (staged / "sub" / "deeper").mkdir(exist_ok=True)
    (staged / "sub" / "deeper" / "inner").mkdir()  # a directory where dest has a file
    with pytest.raises(NotADirectoryError) as refused:
        merge(str(staged), str(dest), None)
    assert refused.value.filename == str(dest / "sub" / "deeper" / "inner")
