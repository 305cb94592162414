"""The namespace guest's ``copy_in`` unpacker, run on its own (it is standard library only).

In a guest it runs as a request's child inside the guest's confinement; here it runs on a temp
dir, fed by the same producers ``copy_in`` uses (the host's GNU tar, ``tarfile``'s PAX) and by
``tarfile``'s other formats, so that every header form it reads is read at least once.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from pytest_smolvm.backends.namespace.helper.unpack import OPEN_LEVELS, Unpacker, _number

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


def _unpack(data: bytes, dest: Path) -> None:
    dest.mkdir(exist_ok=True)
    Unpacker(str(dest), io.BytesIO(data).read).run()


@pytest.mark.parametrize("producer", ["gnu-tar", "tarfile-pax", "tarfile-gnu", "tarfile-ustar"])
def test_every_producer_round_trips(tmp_path: Path, producer: str) -> None:
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
    _unpack(data, dest)
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


def test_a_file_over_a_directory_names_the_full_path(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    (dest / "x").mkdir(parents=True)
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_text("a file\n")
    with pytest.raises(IsADirectoryError) as refused:
        _unpack(_tarfile(src, tarfile.PAX_FORMAT), dest)
    assert refused.value.filename == str(dest / "x")


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
