"""Reading a tar stream member by member, without ``tarfile``: the parser behind :mod:`hostfs`.

``tarfile`` costs ~50 µs of Python per member before a byte is written (a ``TarInfo`` built
field by field, a file object per member, reads through three layers of buffering); a copy of
10,000 small files spent most of its time there. This reads headers straight out of a byte
buffer and hands file data to the caller as slices of what was read. It knows the formats
tar writers produce: v7, ustar, GNU (long names, base-256 numbers, old sparse files) and
POSIX pax (extended and global headers, GNU sparse 0.0, 0.1 and 1.0).

It only parses. The stream may come from a hostile guest: every number and name is checked
for form here, and every rule about what may land where is :mod:`hostfs`'s. Metadata
(long names, pax records, sparse maps) is capped in size and count, since it is held in memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from pytest_smolvm.errors import TarFormatError

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
MAX_META = 1 << 20  # bytes of one long name, pax header or sparse map: names are capped at 4 KiB anyway
MAX_SPARSE = 1 << 16  # entries in one sparse map
# Metadata headers before one member, and their bytes together: GNU tar writes at most a long
# name, a long link and a pax header; without a total, 500 1 MiB pax headers with distinct keys
# before one member were held at once (GBs of dicts).
MAX_META_PER_MEMBER = 16
READ_SIZE = 1 << 20
RECORD_SIZE = 20 * BLOCK  # what tar writers pad an archive to
REGULAR, HARDLINK, SYMLINK, CHARDEV, BLOCKDEV, DIRECTORY, FIFO = "0", "1", "2", "3", "4", "5", "6"
_REGULAR_TYPES = {b"0": REGULAR, b"\0": REGULAR, b"7": REGULAR, b"1": HARDLINK, b"2": SYMLINK,
                  b"3": CHARDEV, b"4": BLOCKDEV, b"5": DIRECTORY, b"6": FIFO}
_SPACES = b" " * 8


class Source(Protocol):
    def read(self, size: int = -1) -> bytes: ...


@dataclass(slots=True)
class Member:
    name: str
    kind: str  # one of the type constants above; anything else was refused already
    mode: int
    size: int  # bytes of data in the stream (for a sparse file: its stored segments only)
    mtime: float
    linkname: str = ""
    uid: int = 0
    gid: int = 0
    sparse: list[tuple[int, int]] | None = None  # (offset, length) segments of a sparse file
    realsize: int = 0  # a sparse file's full size
    pax: dict[str, str] | None = None  # the pax records that applied, if any


class TarReader:
    """Members of the tar stream ``source`` in order; a member's data must be consumed through
    :meth:`data` (or is skipped) before the next member is read."""

    def __init__(self, source: Source, *, max_meta_headers: int, owners: bool = True,
                 read_size: int = READ_SIZE) -> None:
        self._source = source
        self._read_size = read_size
        self._read_total = 0  # bytes read from the source (some maybe still buffered)
        self._owners = owners  # parse uid and gid (only a layer unpacked as root uses them)
        self._buf = b""
        self._pos = 0
        self._unread = 0  # data bytes of the current member not yet consumed
        self._globals: dict[str, str] = {}
        self._meta_left = max_meta_headers
        self.offset = 0  # stream bytes consumed so far

    # ---------------------------------------------------------------- bytes

    def _fill(self, n: int) -> bool:
        """At least ``n`` bytes buffered; False at a clean end of stream before any of them."""
        have = len(self._buf) - self._pos
        if have >= n:
            return True
        parts = [self._buf[self._pos:]]
        while have < n:
            chunk = self._read(n - have)
            if not chunk:
                if have == 0:
                    self._buf, self._pos = b"", 0
                    return False
                raise TarFormatError("the tar stream ends in the middle of a member")
            parts.append(chunk)
            have += len(chunk)
        self._buf, self._pos = b"".join(parts), 0
        return True

    def _read(self, want: int) -> bytes:
        """At least ``want`` bytes asked of the source, up to the next multiple of the read size
        from the stream's start: reading a record at a time, this never asks past the record
        an archive ends in (a decompressor checks its trailer on a read beyond its end)."""
        end = self._read_total + max(want, 1)
        chunk = self._source.read(-(-end // self._read_size) * self._read_size - self._read_total)
        self._read_total += len(chunk)
        return chunk

    def _take(self, n: int) -> bytes:
        if not self._fill(n):
            raise TarFormatError("the tar stream ends in the middle of a member")
        data = self._buf[self._pos:self._pos + n]
        self._pos += n
        self.offset += n
        return data

    def data(self, limit: int = READ_SIZE) -> Iterator[memoryview]:
        """The current member's data, in slices of at most ``limit`` bytes, then its padding skipped."""
        while self._unread:
            if self._pos >= len(self._buf):
                chunk = self._read(min(self._unread, limit))
                if not chunk:
                    raise TarFormatError("the tar stream ends in the middle of a member's data")
                self._buf, self._pos = chunk, 0
            n = min(self._unread, len(self._buf) - self._pos, limit)
            view = memoryview(self._buf)[self._pos:self._pos + n]
            self._pos += n
            self._unread -= n
            self.offset += n
            yield view
        pad = -self.offset % BLOCK
        if pad:
            self._take(pad)

    def small(self) -> memoryview | None:
        """The current member's whole data if it is buffered already (most small files), with its
        padding skipped; None otherwise, and then :meth:`data` streams it."""
        n = self._unread
        end = self._pos + n
        padded = end + (-n % BLOCK)
        if padded > len(self._buf):
            return None
        view = memoryview(self._buf)[self._pos:end]
        self.offset += padded - self._pos
        self._pos = padded
        self._unread = 0
        return view

    def _skip_data(self) -> None:
        for _ in self.data():
            pass

    # ---------------------------------------------------------------- headers

    def __iter__(self) -> Iterator[Member]:
        return self

    def __next__(self) -> Member:
        if self._unread:
            self._skip_data()
        pending: dict[str, str] = {}
        sparse_pairs: list[str] = []
        long_name = long_link = None
        meta_count = meta_bytes = 0
        while True:
            pos = self._pos
            if pos + BLOCK <= len(self._buf):  # the usual case, without two calls per header
                block = self._buf[pos:pos + BLOCK]
                self._pos = pos + BLOCK
                self.offset += BLOCK
            elif not self._fill(BLOCK):
                if self.offset == 0:
                    raise TarFormatError("empty stream: no tar header")
                raise StopIteration  # ended without the two zero blocks: what was sent is whole
            else:
                block = self._take(BLOCK)
            if block == ZERO_BLOCK:
                raise StopIteration
            _check_sum(block)
            typeflag = block[156:157]
            if typeflag in (b"L", b"K", b"x", b"g"):
                self._meta_left -= 1
                if self._meta_left < 0:
                    raise TarFormatError("too many long-name and pax headers")
                size = _number(block[124:136], "size")
                if size > MAX_META:
                    raise TarFormatError(f"a {size}-byte metadata header (more than {MAX_META})")
                meta_count += 1
                meta_bytes += size
                if meta_count > MAX_META_PER_MEMBER or meta_bytes > MAX_META:
                    raise TarFormatError(f"more than {MAX_META_PER_MEMBER} metadata headers or {MAX_META} "
                                         "bytes of them before one member")
                raw = self._take(size)
                self._take(-size % BLOCK)
                if typeflag == b"L":
                    long_name = _text(_field(raw))
                elif typeflag == b"K":
                    long_link = _text(_field(raw))
                else:
                    records = _pax_records(raw, sparse_pairs if typeflag == b"x" else None)
                    if typeflag == b"g":
                        self._globals.update(records)
                        if sum(len(k) + len(v) for k, v in self._globals.items()) > MAX_META:
                            raise TarFormatError("global pax headers over their size cap")
                    else:
                        pending.update(records)
                continue
            return self._member(block, typeflag, {**self._globals, **pending} if self._globals else pending,
                                long_name, long_link, sparse_pairs)

    def _member(self, block: bytes, typeflag: bytes, pax: dict[str, str], long_name: str | None,
                long_link: str | None, sparse_pairs: list[str]) -> Member:
        kind = _REGULAR_TYPES.get(typeflag)
        if kind is None and typeflag != b"S":
            raise TarFormatError(f"unsupported member type {typeflag!r}")
        name = _text(_field(block[0:100]))
        if block[257:263] == b"ustar\0" and block[345] != 0:  # POSIX ustar: a name prefix
            name = _text(_field(block[345:500])) + "/" + name
        if long_name is not None:
            name = long_name
        linkname = long_link if long_link is not None else (
            _text(_field(block[157:257])) if typeflag in (b"1", b"2") else "")
        try:  # inline, the usual "0000644\0" fields: a call per field was a tenth of the parse
            size = int(block[124:136].rstrip(b"\0 "), 8)
            mode = int(block[100:108].rstrip(b"\0 "), 8)
            mtime = int(block[136:148].rstrip(b"\0 "), 8)
        except ValueError:
            size = _number(block[124:136], "size")
            mode = _number(block[100:108], "mode")
            mtime = _number(block[136:148], "mtime")
        if size < 0:
            raise TarFormatError(f"{name[:200]!r}: a negative size")
        if kind == REGULAR and typeflag == b"\0" and name.endswith("/"):
            kind = DIRECTORY  # a v7 directory
        member = Member(name, kind or REGULAR, mode, size, float(mtime), linkname)
        if self._owners:
            member.uid = _number(block[108:116], "uid")
            member.gid = _number(block[116:124], "gid")
        if typeflag == b"S":
            self._gnu_sparse(block, member)
        if pax:
            self._apply_pax(member, pax, sparse_pairs)
        self._unread = member.size
        if pax and pax.get("GNU.sparse.major") == "1" and pax.get("GNU.sparse.minor") == "0":
            self._sparse_map_10(member)
        return member

    def _apply_pax(self, member: Member, pax: dict[str, str], sparse_pairs: list[str]) -> None:
        member.pax = pax
        try:
            if "path" in pax:
                member.name = pax["path"]
            if "linkpath" in pax:
                member.linkname = pax["linkpath"]
            if "size" in pax:
                member.size = int(pax["size"])
            if "mtime" in pax:
                member.mtime = float(pax["mtime"])
            if "uid" in pax and self._owners:
                member.uid = int(pax["uid"])
            if "gid" in pax and self._owners:
                member.gid = int(pax["gid"])
            if "GNU.sparse.name" in pax:
                member.name = pax["GNU.sparse.name"]
            realsize = pax.get("GNU.sparse.realsize", pax.get("GNU.sparse.size"))
            if realsize is not None:
                member.realsize = int(realsize)
                if "GNU.sparse.map" in pax:  # 0.1
                    numbers = [int(n) for n in pax["GNU.sparse.map"].split(",")] if pax["GNU.sparse.map"] else []
                    member.sparse = _pairs(numbers)
                elif sparse_pairs:  # 0.0: offset and numbytes records, in order
                    member.sparse = _pairs([int(n) for n in sparse_pairs])
                elif pax.get("GNU.sparse.major") != "1":
                    raise TarFormatError(f"{member.name[:200]!r}: a sparse file without its map")
        except ValueError as exc:
            raise TarFormatError(f"{member.name[:200]!r}: a malformed pax record: {exc}") from None
        if member.size < 0 or member.mtime != member.mtime:
            raise TarFormatError(f"{member.name[:200]!r}: a negative size or a NaN time")

    def _gnu_sparse(self, block: bytes, member: Member) -> None:
        numbers = [_number(block[pos:pos + 12], "sparse map") for pos in range(386, 482, 12)]
        extended = block[482]
        member.realsize = _number(block[483:495], "sparse size")
        while extended:
            ext = self._take(BLOCK)
            numbers += [_number(ext[pos:pos + 12], "sparse map") for pos in range(0, 504, 12)]
            if len(numbers) > 2 * MAX_SPARSE:
                raise TarFormatError(f"{member.name[:200]!r}: more than {MAX_SPARSE} sparse segments")
            extended = ext[504]
        member.sparse = [(o, n) for o, n in _pairs(numbers) if o or n]

    def _sparse_map_10(self, member: Member) -> None:
        """GNU sparse 1.0: the map is the first blocks of the member's data, decimal lines."""
        text = b""
        numbers: list[int] = []
        count = -1
        consumed = 0
        while count < 0 or len(numbers) < 2 * count:
            if b"\n" not in text:
                if consumed >= MAX_META or self._unread < BLOCK:
                    raise TarFormatError(f"{member.name[:200]!r}: a malformed sparse map")
                text += self._take(BLOCK)
                self._unread -= BLOCK
                consumed += BLOCK
                continue
            line, text = text.split(b"\n", 1)
            try:
                number = int(line)
            except ValueError:
                raise TarFormatError(f"{member.name[:200]!r}: a malformed sparse map") from None
            if count < 0:
                count = number
                if not 0 <= count <= MAX_SPARSE:
                    raise TarFormatError(f"{member.name[:200]!r}: more than {MAX_SPARSE} sparse segments")
            else:
                numbers.append(number)
        member.sparse = _pairs(numbers)
        member.size = self._unread


def _pairs(numbers: list[int]) -> list[tuple[int, int]]:
    if len(numbers) % 2 or len(numbers) > 2 * MAX_SPARSE:
        raise TarFormatError(f"a sparse map of odd length or of more than {MAX_SPARSE} segments")
    return list(zip(numbers[::2], numbers[1::2], strict=True))


def _check_sum(block: bytes) -> None:
    """The header checksum (a sanity check on the stream's framing, not a defence: anyone can
    compute it). Adler-32's low half is 1 + the byte sum mod 65521, computed in C."""
    stored = _number(block[148:156], "checksum")
    spaced = block[:148] + _SPACES + block[156:]
    if (stored + 1) % 65521 == zlib.adler32(spaced) & 0xFFFF:
        return
    total = sum(spaced)
    if stored != total and stored != total - 256 * sum(1 for b in spaced if b >= 128):  # old writers: signed
        raise TarFormatError("a header with a bad checksum: not a tar stream, or a corrupt one")


def _field(raw: bytes) -> bytes:
    end = raw.find(b"\0")
    return raw if end < 0 else raw[:end]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _number(raw: bytes, what: str) -> int:
    """A numeric header field: NUL/space-padded octal, or GNU base-256 (first byte 0x80 or 0xff)."""
    try:
        return int(raw.rstrip(b"\0 "), 8)  # the usual "0000644\0"; anything odd goes the long way
    except ValueError:
        pass
    if raw and raw[0] in (0x80, 0xFF):
        value = int.from_bytes(raw[1:], "big")
        if raw[0] == 0xFF:
            value -= 256 ** (len(raw) - 1)
        return value
    text = _field(raw).strip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarFormatError(f"a header with a malformed {what} field {raw!r}") from None


def _pax_records(raw: bytes, sparse_pairs: list[str] | None) -> dict[str, str]:
    """``"%d %s=%s\\n"`` records; GNU sparse 0.0's repeated offset/numbytes keys kept in order."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(raw):
        if raw[pos] == 0:
            break  # NUL padding after the last record
        space = raw.find(b" ", pos, pos + 24)
        try:
            length = int(raw[pos:space]) if space > pos else 0
        except ValueError:
            length = 0
        end = pos + length
        if length <= 0 or end > len(raw) or raw[end - 1:end] != b"\n" or b"=" not in raw[space + 1:end]:
            raise TarFormatError("a malformed pax header")
        key_raw, value_raw = raw[space + 1:end - 1].split(b"=", 1)
        key = key_raw.decode("utf-8", "surrogateescape")
        value = value_raw.decode("utf-8", "surrogateescape")
        if sparse_pairs is not None and key in ("GNU.sparse.offset", "GNU.sparse.numbytes"):
            sparse_pairs.append(value)
            if len(sparse_pairs) > 2 * MAX_SPARSE:
                raise TarFormatError(f"more than {MAX_SPARSE} sparse segments")
        else:
            records[key] = value
        pos = end
    return records
