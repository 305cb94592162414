"""DNS queries a guest sent to its proxy: a strict, bounded parser and the replies to them.

Every datagram is the guest's: it is read only through bounds-checked slices, and anything
but one plain question (no compression pointer, labels of at most 63 bytes, a name of at
most 255, a datagram of at most 512 bytes, no answer or authority records, at most one
additional record, the EDNS OPT a resolver adds) earns an error reply, never an exception.
The name a guest asked for is shown in presentation form with every byte outside
``[A-Za-z0-9_-]`` escaped as ``\\DDD`` (RFC 1035), so it is inert in every sink.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAX_QUERY = 512  # RFC 1035's UDP limit; a resolver's query is far smaller
MAX_NAME = 255  # wire length, length bytes and root label included
MAX_LABEL = 63
HEADER = struct.Struct("!HHHHHH")

NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
TYPE_A = 1
CLASS_IN = 1
TYPE_NAMES = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA",
              33: "SRV", 64: "SVCB", 65: "HTTPS", 255: "ANY"}
_PLAIN = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


@dataclass(frozen=True)
class Question:
    """One well-formed query: its id and flags, the question as it came on the wire, the name."""

    ident: int
    flags: int
    question: bytes  # QNAME + QTYPE + QCLASS, the bytes the guest sent
    labels: tuple[bytes, ...]
    qtype: int
    qclass: int

    @property
    def name(self) -> str:
        """The name in presentation form, lower case, escaped: safe to show and to compare."""
        return ".".join("".join(chr(b) if b in _PLAIN else f"\\{b:03d}" for b in label.lower())
                        for label in self.labels) or "."

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.qtype, f"TYPE{self.qtype}")


@dataclass(frozen=True)
class Bad:
    """A datagram that gets an error reply (``reply``), or none at all (``reply`` empty: too
    short to carry an id, or itself a response: answering those could make two proxies loop)."""

    reply: bytes
    why: str


def parse_query(data: bytes) -> Question | Bad:
    """``data`` (one datagram from the guest) as a :class:`Question`, or why not."""
    if len(data) < HEADER.size:
        return Bad(b"", "shorter than a DNS header")
    ident, flags, qd, an, ns, ar = HEADER.unpack_from(data)
    if flags & 0x8000:
        return Bad(b"", "a response, not a query")
    if len(data) > MAX_QUERY:
        return Bad(error_reply(ident, flags, FORMERR), f"{len(data)} bytes, over {MAX_QUERY}")
    if (flags >> 11) & 0xF:
        return Bad(error_reply(ident, flags, NOTIMP), "not a standard query")
    if qd != 1 or an or ns or ar > 1:
        return Bad(error_reply(ident, flags, FORMERR), "not exactly one question")
    labels: list[bytes] = []
    at = HEADER.size
    while True:
        if at >= len(data):
            return Bad(error_reply(ident, flags, FORMERR), "the name runs past the datagram")
        length = data[at]
        if length & 0xC0:
            return Bad(error_reply(ident, flags, FORMERR), "a compression pointer in the question")
        if at + 1 + length - HEADER.size > MAX_NAME:
            return Bad(error_reply(ident, flags, FORMERR), f"a name over {MAX_NAME} bytes")
        if length == 0:
            at += 1
            break
        if length > MAX_LABEL or at + 1 + length > len(data):
            return Bad(error_reply(ident, flags, FORMERR), "a label past the datagram")
        labels.append(data[at + 1:at + 1 + length])
        at += 1 + length
    if at + 4 > len(data):
        return Bad(error_reply(ident, flags, FORMERR), "no type and class")
    qtype, qclass = struct.unpack_from("!HH", data, at)
    return Question(ident, flags, data[HEADER.size:at + 4], tuple(labels), qtype, qclass)


def error_reply(ident: int, flags: int, rcode: int, question: bytes = b"") -> bytes:
    """A reply with no records: ``rcode`` (an error, or NOERROR for "no record of that type")."""
    return HEADER.pack(ident, _reply_flags(flags, rcode), 1 if question else 0, 0, 0, 0) + question


def answer_a(query: Question, addresses: list[str], ttl: int) -> bytes:
    """A NOERROR reply to ``query`` with one A record per IPv4 address (none: "no such record")."""
    records = b"".join(struct.pack("!HHHIH4B", 0xC00C, TYPE_A, CLASS_IN, ttl, 4, *map(int, a.split(".")))
                       for a in addresses)
    return (HEADER.pack(query.ident, _reply_flags(query.flags, NOERROR), 1, len(addresses), 0, 0)
            + query.question + records)


def forward_query(ident: int, query: Question) -> bytes:
    """The query rebuilt for the upstream resolver: our id, recursion desired, its question
    alone (nothing else of the guest's datagram goes out: no EDNS option, no extra record)."""
    return HEADER.pack(ident, 0x0100, 1, 0, 0, 0) + query.question


def upstream_reply(data: bytes, ident: int, query: Question) -> bytes | None:
    """The upstream's reply to :func:`forward_query`, given the guest's id; None if it is not one
    (another id, not a response, another question)."""
    if len(data) < HEADER.size + len(query.question):
        return None
    got, flags = struct.unpack_from("!HH", data)
    if got != ident or not flags & 0x8000 or data[HEADER.size:HEADER.size + len(query.question)] != query.question:
        return None
    return struct.pack("!H", query.ident) + data[2:]


def _reply_flags(flags: int, rcode: int) -> int:
    return 0x8000 | (flags & 0x7900) | 0x0080 | rcode  # QR, the query's opcode and RD, RA
