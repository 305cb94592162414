"""The namespace guests' DNS proxy on its own: the strict parser of guest queries, and the proxy
thread's policy, relaying and lifetime, against a fake upstream on this host's loopback.

Runs anywhere (no root): the guest's socket is a plain UDP socket here. The whole path, in
real guests and with a stand-in internet, is in test_egress.py.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_smolvm.backends.namespace import dns
from pytest_smolvm.untrusted import dnswire

Upstream = tuple[tuple[str, int], list[bytes]]  # the fake resolver's address, and what it was asked


def query(name: bytes, qtype: int = 1, ident: int = 0x1234, **header: int) -> bytes:
    counts = (header.get("qd", 1), header.get("an", 0), header.get("ns", 0), header.get("ar", 0))
    wire = b"".join(bytes([len(label)]) + label for label in name.split(b".") if label) + b"\0"
    return struct.pack("!HHHHHH", ident, header.get("flags", 0x0100), *counts) + wire + struct.pack("!HH", qtype, 1)


def rcode(reply: bytes) -> int:
    return reply[3] & 0xF


def test_a_plain_query_parses_and_its_name_is_escaped() -> None:
    parsed = dnswire.parse_query(query(b"Allowed.TEST", qtype=28))
    assert isinstance(parsed, dnswire.Question)
    assert (parsed.name, parsed.type_name, parsed.ident) == ("allowed.test", "AAAA", 0x1234)
    odd = dnswire.parse_query(query(b"\x1b]0;x y.\xff"))
    assert isinstance(odd, dnswire.Question) and odd.name == "\\027\\0930\\059x\\032y.\\255"


@pytest.mark.parametrize(("data", "code"), [
    (query(b"a.test", qd=2), dnswire.FORMERR),
    (query(b"a.test", an=1), dnswire.FORMERR),
    (query(b"a.test", ar=2), dnswire.FORMERR),
    (query(b"a.test", flags=0x2900), dnswire.NOTIMP),  # opcode 5 (UPDATE)
    (struct.pack("!HHHHHH", 7, 0x100, 1, 0, 0, 0) + b"\xc0\x0c\0\1\0\1", dnswire.FORMERR),  # a pointer
    (struct.pack("!HHHHHH", 7, 0x100, 1, 0, 0, 0) + b"\x40" + b"a" * 64 + b"\0\0\1\0\1", dnswire.FORMERR),
    (struct.pack("!HHHHHH", 7, 0x100, 1, 0, 0, 0) + b"\x3fabc", dnswire.FORMERR),  # a label past the end
    (struct.pack("!HHHHHH", 7, 0x100, 1, 0, 0, 0) + b"\1a\0\0\1", dnswire.FORMERR),  # no class
    (query(b".".join([b"a" * 63] * 4)), dnswire.FORMERR),  # 257 bytes of name
    (query(b"a.test") + b"\0" * 600, dnswire.FORMERR),  # over 512 bytes
], ids=["two-questions", "an-answer", "two-additional", "opcode", "pointer", "label-64", "short-label",
        "no-class", "name-257", "over-512"])
def test_anything_but_one_plain_question_gets_an_error_reply(data: bytes, code: int) -> None:
    parsed = dnswire.parse_query(data)
    assert isinstance(parsed, dnswire.Bad)
    assert parsed.reply[:2] == data[:2] and parsed.reply[2] & 0x80 and rcode(parsed.reply) == code


@pytest.mark.parametrize("first", [0xC0, 0x80, 0x40], ids=["pointer", "reserved-10", "extended-01"])
def test_a_compression_pointer_is_never_followed(first: int) -> None:
    # After a label, so that the pointer's target (offset 12) would be a well-formed name again.
    data = struct.pack("!HHHHHH", 7, 0x100, 1, 0, 0, 0) + b"\1a" + bytes([first, 12]) + b"\0\1\0\1"
    parsed = dnswire.parse_query(data)
    assert isinstance(parsed, dnswire.Bad) and "compression pointer" in parsed.why


def test_a_name_of_exactly_255_bytes_is_fine() -> None:
    name = b".".join([b"a" * 63] * 3 + [b"a" * 61])  # 3*64 + 62 + root = 255
    assert isinstance(dnswire.parse_query(query(name)), dnswire.Question)


@pytest.mark.parametrize("data", [b"", b"\x12\x34\x01", query(b"a.test", flags=0x8180)],
                         ids=["empty", "no-header", "a-response"])
def test_no_reply_where_there_is_no_id_or_it_is_a_response(data: bytes) -> None:
    parsed = dnswire.parse_query(data)
    assert isinstance(parsed, dnswire.Bad) and parsed.reply == b""


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=600) | st.builds(lambda a, b: query(b"a.test")[:a] + b, st.integers(0, 30),
                                           st.binary(max_size=40)))
def test_the_parser_never_raises(data: bytes) -> None:
    parsed = dnswire.parse_query(data)
    if isinstance(parsed, dnswire.Question):
        assert len(parsed.question) <= dnswire.MAX_NAME + 4 and all(len(x) <= 63 for x in parsed.labels)
    else:
        assert len(parsed.reply) <= 12


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    """A fake resolver on the loopback: answers A for every name with 192.0.2.1, after one forged
    reply with a wrong id; keeps what it was asked."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    asked: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                data, peer = sock.recvfrom(4096)
            except OSError:
                return
            if len(data) < 12:
                return  # shut down
            asked.append(data)
            question = data[12:]
            forged = struct.pack("!HHHHHH", (data[0] << 8 | data[1]) ^ 1, 0x8180, 1, 0, 0, 0) + question
            sock.sendto(forged, peer)
            reply = data[:2] + struct.pack("!HHHHH", 0x8180, 1, 1, 0, 0) + question
            sock.sendto(reply + struct.pack("!HHHIH4B", 0xC00C, 1, 1, 60, 4, 192, 0, 2, 1), peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname(), asked
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stop:
        stop.sendto(b"", sock.getsockname())  # an empty datagram ends it
    thread.join(5)
    sock.close()


def _guest_socket() -> tuple[socket.socket, tuple[str, int]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()


def _ask(address: tuple[str, int], data: bytes, timeout: float = 2) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.settimeout(timeout)
        client.sendto(data, address)
        try:
            return client.recv(4096)
        except TimeoutError:
            return None


def _proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "smolvm-dns-proxy"]


def _until_no_proxy_thread(seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while _proxy_threads() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_network_true_relays_the_matching_reply_and_drops_a_forged_one(upstream: Upstream) -> None:
    server, asked = upstream
    sock, address = _guest_socket()
    guest = dns.serve(sock.detach(), server, None)
    try:
        reply = _ask(address, query(b"example.test", ident=0x4242) + b"\0\0\x29\x10\0\0\0\0\0\0\0")  # + EDNS OPT
        assert reply is not None and reply[:2] == b"\x42\x42" and reply.endswith(bytes([192, 0, 2, 1]))
        [sent] = asked
        assert sent[12:] == query(b"example.test")[12:], "only the question goes upstream, no EDNS"
        assert [a.render() for a in guest.ledger()] == ["allowed dns example.test A (1x)"]
    finally:
        dns.stop(guest)


def test_allow_hosts_answers_its_names_locally_and_nxdomain_for_others(upstream: Upstream) -> None:
    _server, asked = upstream
    sock, address = _guest_socket()
    guest = dns.serve(sock.detach(), None, {"Allowed.test": ["10.9.8.7"]})
    try:
        ok = _ask(address, query(b"allowed.TEST."))
        assert ok is not None and rcode(ok) == dnswire.NOERROR and ok.endswith(bytes([10, 9, 8, 7]))
        v6 = _ask(address, query(b"allowed.test", qtype=28))
        assert v6 is not None and rcode(v6) == dnswire.NOERROR and v6[6:8] == b"\0\0"  # no AAAA: NODATA
        other = _ask(address, query(b"other.test"))
        assert other is not None and rcode(other) == dnswire.NXDOMAIN
        assert _ask(address, query(b"x.test", qd=2)) is not None
        assert asked == [], "allow_hosts asked upstream"
        rows = [a.render() for a in guest.ledger()]
        assert rows == ["allowed dns allowed.test A,AAAA (2x)", "refused dns (malformed queries) (1x)",
                        "refused dns other.test A (1x)"], rows
    finally:
        dns.stop(guest)


def test_upstream_silence_is_servfail_and_the_proxy_serves_on() -> None:
    sock, address = _guest_socket()
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))  # a resolver that never answers
    guest = dns.serve(sock.detach(), silent.getsockname(), None)
    try:
        reply = _ask(address, query(b"slow.test"), timeout=dns.DNS_UPSTREAM_TIMEOUT + 3)
        assert reply is not None and rcode(reply) == dnswire.SERVFAIL
        assert rcode(_ask(address, query(b"x", qd=0)) or b"\0\0\0\0") == dnswire.FORMERR
        silent.close()  # now nothing listens: refused at once, SERVFAIL at once
        started = time.monotonic()
        reply = _ask(address, query(b"gone.test"))
        assert reply is not None and rcode(reply) == dnswire.SERVFAIL and time.monotonic() - started < 1
    finally:
        dns.stop(guest)
        silent.close()


def test_the_thread_and_every_socket_go_with_the_last_guest(upstream: Upstream) -> None:
    server, _asked = upstream
    _until_no_proxy_thread()  # an earlier test's, on its way out after its last guest went
    before = set(os.listdir("/proc/self/fd"))
    guests = []
    for _ in range(3):
        sock, address = _guest_socket()
        guests.append((dns.serve(sock.detach(), server, None), address))
    assert len(_proxy_threads()) == 1
    for _guest, address in guests:
        assert _ask(address, query(b"a.test")) is not None
    for guest, _address in guests:
        dns.stop(guest)
        dns.stop(guest)  # twice: a retried destroy
    _until_no_proxy_thread()
    assert _proxy_threads() == [], "the proxy thread outlived its last guest"
    assert set(os.listdir("/proc/self/fd")) - before == set(), "the proxy left fds open"
    sock, address = _guest_socket()  # and a later guest starts it again
    guest = dns.serve(sock.detach(), server, None)
    try:
        assert _ask(address, query(b"again.test")) is not None
    finally:
        dns.stop(guest)
