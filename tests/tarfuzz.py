"""Hostile tar streams made by Hypothesis, and the one property every host-side unpack must keep.

Shared by ``tests/security/test_fuzz_extract.py`` (a short run in CI) and
``benchmarks/fuzz_extract.py`` (a long run). A case is a list of members (files, dirs, sym and
hard links in any order, to ``..``, absolute paths and through each other, long names, FIFOs,
GNU and pax sparse files with hostile maps, duplicates), written in GNU, pax or ustar form,
then maybe cut short or with header bytes changed (checksum fixed, so the parser reads them).

The property: the unpack returns, or raises :class:`UnsafeArchive` (the project's error), and
nothing else; a canary tree beside the destination is byte for byte, inode for inode, as it
was; nothing new appears outside the destination; a copy's links resolve inside the copy; and
the in-process walker's Python allocations stay under a bound.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hypothesis import strategies as st

from pytest_smolvm.errors import UnsafeArchive
from pytest_smolvm.untrusted import confined, hostfs, rules

PAYLOAD = "payload"  # copy_out's prefix: the copied tree's root inside the stream
CANARY = "@CANARY@"  # replaced by the canary dir's absolute path once a case has its own tmp dir
MEMORY_BOUND = 24 << 20  # bytes of Python allocations one in-process unpack of a small case may peak at
CAPS = rules.Caps(max_bytes=4 << 20, max_members=200, timeout=30.0)

# Components a name or link is built from: the tree's own, the way out, the canary's, long ones.
PLAIN = ["a", "b", "d", "a", "b", PAYLOAD, "x" * 100, "y" * 255, "\u00e9", "\udcff"]
HOSTILE = ["..", ".", "", "host", "secret", "link", "..", ".."]
KINDS = ["file"] * 4 + ["dir"] * 4 + ["symlink"] * 3 + ["hardlink"] * 3 + ["sparse"] * 2 + ["fifo", "chardev"]
PAX_KEYS = ["path", "linkpath", "size", "mtime", "uid", "gid", "GNU.sparse.size", "GNU.sparse.major"]
PAX_VALUES = ["..", "/etc", CANARY + "/secret", "-1", "0", "1", "nan", "1e400", "99999999999999999999", ""]
POLICIES: dict[str, Callable[[], rules.Policy]] = {
    "copy_out": lambda: rules.Policy("copy_out", prefix=PAYLOAD),
    "layer": lambda: rules.Policy("layer", layer=True),
    "export": lambda: rules.Policy("export", layer=True, guest_export=True),
}


@dataclass
class Case:
    members: list[dict[str, Any]]
    fmt: Literal[0, 1, 2]  # tarfile.USTAR_FORMAT, GNU_FORMAT or PAX_FORMAT
    cut: int | None  # percent of the stream's bytes kept, if cut short
    flips: list[tuple[int, int, int]]  # (header index, offset in it, new byte)
    trailer: bool


def _one_in(draw: st.DrawFn, n: int) -> bool:
    """True about once in ``n`` draws (``integers(0, n - 1) == 0`` is far likelier: Hypothesis
    favours small numbers)."""
    return draw(st.sampled_from(range(n))) == n - 1


def _path(draw: st.DrawFn, *, link: bool) -> str:
    """A name: mostly the tree's own components, sometimes a way out, sometimes very deep."""
    parts = draw(st.lists(st.sampled_from(PLAIN), min_size=0, max_size=5))
    for _ in range(draw(st.integers(0, 3 if link else 1))):
        if _one_in(draw, 3 if link else 10):
            parts.insert(draw(st.integers(0, len(parts))), draw(st.sampled_from(HOSTILE)))
    if _one_in(draw, 16):  # deep: past the recursion limit, just under MAX_NAME, past it
        parts = parts + ["z"] * draw(st.sampled_from([1, 2, 1100, 2030, 2100]))
    text = "/".join(parts)
    starts = ["payload/"] * 8 + ["", "./", "/"] + ([CANARY + "/", "../", "", ""] if link else [])
    return draw(st.sampled_from(starts)) + text


@st.composite
def members(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    member: dict[str, Any] = {"kind": kind, "name": _path(draw, link=False),
                              "mode": draw(st.sampled_from([0o644, 0o755, 0o4755, 0o777, 0o000, 0o1777, 0o7777]))}
    if kind in ("symlink", "hardlink"):
        member["link"] = _path(draw, link=True)
    elif kind == "file":
        member["data"] = draw(st.binary(max_size=600)) if draw(st.booleans()) else bytes(draw(st.integers(0, 1 << 17)))
    elif kind == "sparse":
        member["style"] = draw(st.sampled_from(["gnu", "pax0.0", "pax0.1", "pax1.0"]))
        member["map"] = draw(st.lists(st.tuples(st.integers(-2, 1 << 20), st.integers(-2, 4096)), max_size=6))
        member["realsize"] = draw(st.sampled_from([0, 4096, 1 << 20, 1 << 40, (1 << 63) - 1]))
        member["stored"] = draw(st.integers(0, 5000))
    if _one_in(draw, 5):  # pax records that override the header's own fields
        keys = draw(st.lists(st.sampled_from(PAX_KEYS), max_size=3, unique=True))
        member["pax"] = {key: draw(st.sampled_from(PAX_VALUES)) if draw(st.booleans()) else _path(draw, link=True)
                         for key in keys}
    return member


@st.composite
def cases(draw: st.DrawFn) -> Case:
    found = draw(st.lists(members(), min_size=1, max_size=8))
    if found and bool(draw(st.booleans())):
        found.append(dict(draw(st.sampled_from(found))))  # a duplicate, maybe of a link
    if found and bool(draw(st.booleans())):
        # Something else where a member's parent dir was: a dir (maybe deep) replaced, a link over it.
        shadowed = draw(st.sampled_from(found))["name"].rstrip("/")
        if "/" in shadowed:
            parent = shadowed[:draw(st.sampled_from([i for i, c in enumerate(shadowed) if c == "/"]))]
            found.append({**draw(members()), "name": parent})
    fmt: Literal[0, 1, 2] = draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]))
    cut = draw(st.integers(0, 100)) if _one_in(draw, 6) else None  # percent of the stream kept
    flips = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 511), st.integers(0, 255)), max_size=3)) \
        if _one_in(draw, 6) else []
    return Case(found, fmt, cut, flips, draw(st.booleans()))


# --------------------------------------------------------------------------- writing a case


def _header(name: str, typeflag: bytes, size: int, *, mode: int = 0o644, linkname: str = "",
            extra: bytes = b"") -> bytes:
    """One raw header block (GNU magic), its checksum computed; ``extra`` fills bytes 345..500."""
    block = bytearray(512)
    block[0:100] = name.encode("utf-8", "surrogateescape")[:100].ljust(100, b"\0")
    block[100:108] = b"%07o\0" % (mode & 0o7777)
    block[108:124] = b"0000000\x000000000\0"
    block[124:136] = _octal(size, 12)
    block[136:148] = b"00000000000\0"
    block[156:157] = typeflag
    block[157:257] = linkname.encode("utf-8", "surrogateescape")[:100].ljust(100, b"\0")
    block[257:265] = b"ustar  \0"
    block[345:345 + len(extra)] = extra
    return _sum(bytes(block))


def _octal(value: int, width: int) -> bytes:
    if 0 <= value < 8 ** (width - 1):
        return b"%0*o\0" % (width - 1, value)
    modulus: int = 256 ** (width - 1)  # an int's power of an int: Any to the type checker
    return b"\x80" + (value % modulus).to_bytes(width - 1, "big")  # GNU base-256


def _sum(block: bytes) -> bytes:
    raw = bytearray(block)
    raw[148:156] = b" " * 8
    raw[148:156] = b"%06o\0 " % sum(raw)
    return bytes(raw)


def _pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def _pax(records: dict[str, str], sparse_pairs: Sequence[tuple[int, int]] = ()) -> bytes:
    """A pax header block and its records (GNU sparse 0.0's offset/numbytes pairs repeat, in order)."""
    body = b""
    items = [*records.items()]
    for offset, numbytes in sparse_pairs:
        items += [("GNU.sparse.offset", str(offset)), ("GNU.sparse.numbytes", str(numbytes))]
    for key, value in items:
        text = f" {key}={value}\n".encode("utf-8", "surrogateescape")
        n = len(text) + 1
        while len(str(n)) + len(text) != n:
            n = len(str(n)) + len(text)
        body += str(n).encode() + text
    return _header("././@PaxHeader", b"x", len(body)) + _pad(body)


def _sparse(member: dict[str, Any], name: str) -> bytes:
    style, pairs, realsize, stored = member["style"], member["map"], member["realsize"], member["stored"]
    data = bytes(range(256)) * (stored // 256) + bytes(stored % 256)
    if style == "gnu":
        extra = bytearray(155)
        entries = [_octal(max(o, 0), 12) + _octal(max(n, 0), 12) for o, n in pairs]
        for i, entry in enumerate(entries[:4]):  # offsets 386.. are 41.. in the prefix field
            extra[41 + 24 * i:65 + 24 * i] = entry
        extra[137] = 1 if len(entries) > 4 else 0
        extra[138:150] = _octal(realsize, 12)
        out = _header(name, b"S", stored, extra=bytes(extra))
        rest = entries[4:]
        while rest:
            ext = bytearray(512)
            for i, entry in enumerate(rest[:21]):
                ext[24 * i:24 * i + 24] = entry
            rest = rest[21:]
            ext[504] = 1 if rest else 0
            out += bytes(ext)
        return out + _pad(data)
    if style == "pax0.0":
        return _pax({"GNU.sparse.size": str(realsize), "GNU.sparse.numblocks": str(len(pairs))}, pairs) \
            + _header(name, b"0", stored) + _pad(data)
    if style == "pax0.1":
        numbers = ",".join(str(n) for pair in pairs for n in pair)
        return _pax({"GNU.sparse.size": str(realsize), "GNU.sparse.map": numbers, "GNU.sparse.name": name}) \
            + _header("GNUSparseFile.0/x", b"0", stored) + _pad(data)
    lines = f"{len(pairs)}\n" + "".join(f"{o}\n{n}\n" for o, n in pairs)
    mapped = _pad(lines.encode()) + data
    return _pax({"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
                 "GNU.sparse.realsize": str(realsize)}) + _header("GNUSparseFile.0/x", b"0", len(mapped)) + _pad(mapped)


def _subst(text: str, canary: str) -> str:
    return text.replace(CANARY, canary)


def write(case: Case, canary: Path) -> bytes:
    """The case as tar bytes; ``canary``'s absolute path stands in for its placeholder."""
    out = io.BytesIO()
    for member in case.members:
        name = _subst(member["name"], str(canary))
        kind = member["kind"]
        if kind == "sparse":
            out.write(_sparse(member, name))
            continue
        info = tarfile.TarInfo(name)
        info.mode = member["mode"]
        info.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                     "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE, "chardev": tarfile.CHRTYPE}[kind]
        info.linkname = _subst(member.get("link", ""), str(canary))
        data = member.get("data", b"")
        info.size = len(data)
        info.pax_headers = {k: _subst(v, str(canary)) for k, v in member.get("pax", {}).items()}
        try:
            header = info.tobuf(case.fmt, "utf-8", "surrogateescape")
        except ValueError:  # ustar cannot say it: the GNU form can
            header = info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
        out.write(header + _pad(data))
    if case.trailer:
        out.write(bytes(1024))
    raw = bytearray(out.getvalue())
    for index, offset, value in case.flips:  # header bytes changed, checksum made right again
        start = index * 512
        if start + 512 <= len(raw):
            raw[start + offset] = value
            raw[start:start + 512] = _sum(bytes(raw[start:start + 512]))
    return bytes(raw if case.cut is None else raw[:len(raw) * case.cut // 100])


# --------------------------------------------------------------------------- the property


class Canary:
    """Everything under ``root`` but ``dest``: names, types, modes, inodes, link counts, bytes."""

    def __init__(self, root: Path, dest: Path) -> None:
        self.root, self.dest = root, dest
        self.dir = root / "d1" / "host"
        for where in (root / "host", self.dir):
            (where / "sub").mkdir(parents=True)
            (where / "secret").write_bytes(b"host data\n")
            (where / "sub" / "file").write_bytes(b"more host data\n")
            os.symlink("secret", where / "link")
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, tuple[Any, ...]]:
        found: dict[str, tuple[Any, ...]] = {}
        for path, st_ in _walk(self.root, skip=self.dest):
            data = path.read_bytes() if stat.S_ISREG(st_.st_mode) else b""
            target = os.readlink(path) if stat.S_ISLNK(st_.st_mode) else ""
            found[str(path)] = (st_.st_mode, st_.st_ino, st_.st_nlink, st_.st_uid, st_.st_gid, st_.st_size,
                                st_.st_mtime_ns, data, target)
        return found


def _walk(top: Path, skip: Path | None = None) -> Iterator[tuple[Path, os.stat_result]]:
    """Every entry under ``top`` with its lstat, links not followed; a loop, not recursion (os.walk
    recurses per level, and a case's tree may be 2,000 levels deep)."""
    stack = [top]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                path = Path(entry.path)
                if path == skip:
                    continue
                st_ = entry.stat(follow_symlinks=False)
                yield path, st_
                if stat.S_ISDIR(st_.st_mode):
                    stack.append(path)


def check(case: Case, wall: str, policy_name: str) -> str:
    """Run ``case`` through ``wall`` ("in-process" or "confined") by ``policy_name``'s rules and
    assert the property; returns "ok" or "refused"."""
    root = Path(tempfile.mkdtemp(prefix="tarfuzz-"))
    try:
        dest = root / "d1" / "dest"
        dest.mkdir(parents=True)
        canary = Canary(root, dest)
        data = write(case, canary.dir)
        policy = POLICIES[policy_name]()
        unpack = hostfs.extract if wall == "in-process" else confined.extract
        outcome = "ok"
        tracing = wall == "in-process"
        if tracing:
            tracemalloc.start()
        try:
            unpack(io.BytesIO(data), dest, policy, CAPS)
        except UnsafeArchive:
            outcome = "refused"
        finally:
            if tracing:
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
        if tracing:
            assert peak < MEMORY_BOUND + 4 * len(data), f"the walker peaked at {peak} bytes"
        after = canary.snapshot()
        assert after == canary.before, _diff(canary.before, after)
        if outcome == "ok" and policy_name == "copy_out":
            _links_stay_inside(dest / PAYLOAD)
        return outcome
    finally:
        _remove(root)


def _diff(before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]) -> str:
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return f"outside the destination, changed: {changed[:5]}"


def _links_stay_inside(top: Path) -> None:
    """Every link in the copy leads inside it, as the kernel resolves it (by fds: a case's tree
    can be deeper than PATH_MAX). A dangling link is judged by the dir a write through it would
    create its file in."""
    try:
        top_fd = os.open(top, _DIR | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError, OSError):
        return  # no tree, or a file or link at the top (a link there is the extractor's to refuse)
    inside = os.fstat(top_fd)
    pending = [top_fd]
    while pending:
        fd = pending.pop()
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        assert _lands_inside(fd, entry.name, inside), f"link {entry.name!r} leads outside"
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append(os.open(entry.name, _DIR | os.O_NOFOLLOW, dir_fd=fd))
        finally:
            os.close(fd)


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


def _lands_inside(dir_fd: int, name: str, inside: os.stat_result) -> bool:
    target = os.readlink(name, dir_fd=dir_fd)
    head, _, last = target.rpartition("/")
    where = target if last in ("", ".", "..") else (head or ("/" if target.startswith("/") else "."))
    try:
        fd = os.open(where, _PATH_DIR, dir_fd=dir_fd)  # the kernel follows every link on the way
    except OSError:
        return True  # that dir does not exist: nothing can be written through the link
    root = os.stat("/")
    try:
        for _ in range(10_000):
            st_ = os.fstat(fd)
            if (st_.st_dev, st_.st_ino) == (inside.st_dev, inside.st_ino):
                return True
            if (st_.st_dev, st_.st_ino) == (root.st_dev, root.st_ino):
                return False
            up = os.open("..", _PATH_DIR, dir_fd=fd)
            os.close(fd)
            fd = up
        return False
    finally:
        os.close(fd)


def _remove(root: Path) -> None:
    # rm, not shutil.rmtree: a case's tree may be 2,000 dirs deep (shutil recurses per level).
    subprocess.run(["rm", "-rf", "--", str(root)], check=True)
