"""The DNS proxy of namespace guests with the network on, and the names each guest asked for.

The guest's setup process binds a UDP socket to 127.0.0.53:53 in the guest's own network
namespace, before anything of the guest runs, and sends it to the host with its namespaces;
the guest's /etc/resolv.conf names it. One thread of this process (started with the first
networked guest, gone with the last) reads every guest's socket: each query is parsed by
``untrusted.dnswire`` (strict, bounded), noted in that guest's ledger, and then

- ``network=True``: rebuilt (our id, its question alone) and sent to the host's resolver (the
  first ``nameserver`` of the host's /etc/resolv.conf, read when the guest is made); the reply
  with our id and the same question is relayed, anything else is dropped; no reply in
  ``DNS_UPSTREAM_TIMEOUT``: SERVFAIL;
- ``allow_hosts``: a name on the list is answered from the addresses it had when the guest was
  made (the same the guest's routes let through: an upstream answer could name an address the
  routes refuse, and a name that moves mid-test keeps its creation-time address); any other
  name gets NXDOMAIN (musl ignores REFUSED and would wait out its timeout).

The guest picks nothing but the name: no server, no TCP (nothing listens there), no EDNS or
extra record goes upstream. Guest bytes never raise here: a bad query gets an error reply.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pytest_smolvm.backends.base import EgressAttempt
from pytest_smolvm.host.signals import start_thread
from pytest_smolvm.untrusted import dnswire

GUEST_ADDRESS = "127.0.0.53"
RESOLV_CONF = f"nameserver {GUEST_ADDRESS}\n"
DNS_UPSTREAM_TIMEOUT = 3.0  # seconds the host's resolver has to answer one query
DNS_PENDING_MAX = 32  # queries of one guest waiting upstream at once; more get SERVFAIL
DNS_NAMES_KEPT = 256  # names listed per guest; queries for names past these are counted
DNS_TTL = 30  # seconds, for the answers the proxy gives itself (allow_hosts)
MORE_NAMES = "(more names)"  # ledger rows that are no name: their spaces cannot be in an escaped name
MALFORMED = "(malformed queries)"


def host_resolver(path: str = "/etc/resolv.conf") -> tuple[str, int] | None:
    """The first ``nameserver`` of the host's resolver configuration, port 53; None if there is none."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            return fields[1].split("%")[0], 53
    return None


@dataclass
class _Name:
    allowed: bool
    queries: int = 0
    types: set[str] = field(default_factory=set)


class GuestDns:
    """One guest's proxy socket, its policy and its ledger of names."""

    def __init__(self, sock: socket.socket, upstream: tuple[str, int] | None,
                 names: Mapping[str, list[str]] | None) -> None:
        self.sock = sock
        self.upstream = upstream
        self.names = None if names is None else {n.lower().rstrip("."): list(a) for n, a in names.items()}
        self.pending = 0
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._ledger: dict[str, _Name] = {}
        self._more = 0
        self._malformed = 0

    def note(self, name: str, qtype: str, allowed: bool) -> None:
        with self._lock:
            entry = self._ledger.get(name)
            if entry is None:
                if len(self._ledger) >= DNS_NAMES_KEPT:
                    self._more += 1
                    return
                entry = self._ledger[name] = _Name(allowed)
            entry.queries += 1
            entry.types.add(qtype)

    def note_malformed(self) -> None:
        with self._lock:
            self._malformed += 1

    def ledger(self) -> list[EgressAttempt]:
        """The names asked so far, most queries first, as ledger rows (protocol ``dns``)."""
        with self._lock:
            rows = [EgressAttempt(name, "dns", 0, e.allowed, e.queries, ",".join(sorted(e.types)))
                    for name, e in self._ledger.items()]
            if self._more:
                rows.append(EgressAttempt(MORE_NAMES, "dns", 0, self.names is None, self._more))
            if self._malformed:
                rows.append(EgressAttempt(MALFORMED, "dns", 0, False, self._malformed))
        return sorted(rows, key=lambda a: (-a.connections, a.address))


@dataclass
class _Upstream:
    guest: GuestDns
    client: tuple[str, int]
    query: dnswire.Question
    ident: int
    deadline: float


class _Proxy:
    """The one thread that serves every guest's socket. All selector changes happen on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._adds: list[GuestDns] = []
        self._removes: list[GuestDns] = []

    def add(self, guest: GuestDns) -> None:
        with self._lock:
            self._adds.append(guest)
            if self._thread is None:
                self._wake = socket.socketpair()
                self._thread = start_thread(self._serve, name="smolvm-dns-proxy",
                                            args=(selectors.DefaultSelector(), self._wake))
            else:
                self._poke()

    def remove(self, guest: GuestDns, timeout: float = 5.0) -> None:
        """Stop serving ``guest`` and close its socket (on the proxy's thread; waits for it)."""
        with self._lock:
            if guest.closed.is_set():
                return
            if guest in self._adds:  # never served: nothing registered it
                self._adds.remove(guest)
                guest.sock.close()
                guest.closed.set()
                return
            self._removes.append(guest)
            self._poke()
        guest.closed.wait(timeout)

    def _poke(self) -> None:
        if self._wake is not None:
            try:
                self._wake[1].send(b"x")
            except BlockingIOError:
                pass  # already woken: its buffer is full of pokes

    def _serve(self, sel: selectors.BaseSelector, wake: tuple[socket.socket, socket.socket]) -> None:
        wake[0].setblocking(False)
        wake[1].setblocking(False)
        sel.register(wake[0], selectors.EVENT_READ, None)
        served: set[GuestDns] = set()
        waiting: dict[socket.socket, _Upstream] = {}
        try:
            while True:
                with self._lock:
                    for guest in self._adds:
                        sel.register(guest.sock, selectors.EVENT_READ, guest)
                        served.add(guest)
                    self._adds.clear()
                    for guest in self._removes:
                        self._drop(sel, guest, served, waiting)
                    self._removes.clear()
                    if not served:
                        self._thread = self._wake = None  # the next add starts a new thread
                        return
                now = time.monotonic()
                timeout = min((u.deadline for u in waiting.values()), default=now + 60) - now
                for key, _mask in sel.select(max(timeout, 0)):
                    if key.data is None:
                        while _recv(wake[0], 512) is not None:
                            pass
                    elif isinstance(key.data, GuestDns):
                        self._query(sel, key.data, waiting)
                    else:
                        self._reply(sel, key.fileobj, waiting)  # type: ignore[arg-type]
                now = time.monotonic()
                for up_sock in [s for s, u in waiting.items() if u.deadline <= now]:
                    up = self._close_upstream(sel, up_sock, waiting)
                    _send(up.guest, dnswire.error_reply(up.query.ident, up.query.flags, dnswire.SERVFAIL,
                                                        up.query.question), up.client)
        finally:
            with self._lock:
                if self._thread is threading.current_thread():  # a crash: the next add starts over
                    self._thread = self._wake = None
            for up_sock in list(waiting):
                self._close_upstream(sel, up_sock, waiting)
            for guest in served:
                guest.sock.close()
                guest.closed.set()
            sel.close()
            wake[0].close()
            wake[1].close()

    def _drop(self, sel: selectors.BaseSelector, guest: GuestDns, served: set[GuestDns],
              waiting: dict[socket.socket, _Upstream]) -> None:
        for up_sock in [s for s, u in waiting.items() if u.guest is guest]:
            self._close_upstream(sel, up_sock, waiting)
        if guest in served:
            sel.unregister(guest.sock)
            served.discard(guest)
        guest.sock.close()
        guest.closed.set()

    def _query(self, sel: selectors.BaseSelector, guest: GuestDns, waiting: dict[socket.socket, _Upstream]) -> None:
        for _ in range(64):  # a burst at a time: other guests get their turn
            got = _recvfrom(guest.sock)
            if got is None:
                return
            data, client = got
            query = dnswire.parse_query(data)
            if isinstance(query, dnswire.Bad):
                guest.note_malformed()
                if query.reply:
                    _send(guest, query.reply, client)
                continue
            allowed = guest.names is None or query.name.rstrip(".") in guest.names
            guest.note(query.name, query.type_name, allowed)
            if query.qclass != dnswire.CLASS_IN:
                _send(guest, dnswire.error_reply(query.ident, query.flags, dnswire.REFUSED, query.question), client)
            elif guest.names is not None:
                addresses = guest.names.get(query.name.rstrip(".")) if allowed else None
                reply = (dnswire.error_reply(query.ident, query.flags, dnswire.NXDOMAIN, query.question)
                         if addresses is None else
                         dnswire.answer_a(query, addresses if query.qtype == dnswire.TYPE_A else [], DNS_TTL))
                _send(guest, reply, client)
            else:
                self._forward(sel, guest, query, client, waiting)

    def _forward(self, sel: selectors.BaseSelector, guest: GuestDns, query: dnswire.Question,
                 client: tuple[str, int], waiting: dict[socket.socket, _Upstream]) -> None:
        if guest.upstream is None or guest.pending >= DNS_PENDING_MAX:
            _send(guest, dnswire.error_reply(query.ident, query.flags, dnswire.SERVFAIL, query.question), client)
            return
        try:
            family = socket.AF_INET6 if ":" in guest.upstream[0] else socket.AF_INET
            up_sock = socket.socket(family, socket.SOCK_DGRAM)
        except OSError:  # out of fds: the guest's query fails, the proxy goes on
            _send(guest, dnswire.error_reply(query.ident, query.flags, dnswire.SERVFAIL, query.question), client)
            return
        ident = int.from_bytes(os.urandom(2), "big")  # unguessable: an off-path reply must guess it
        try:
            up_sock.setblocking(False)
            up_sock.connect(guest.upstream)  # the kernel then drops datagrams from anyone else
            up_sock.send(dnswire.forward_query(ident, query))
        except OSError:
            up_sock.close()
            _send(guest, dnswire.error_reply(query.ident, query.flags, dnswire.SERVFAIL, query.question), client)
            return
        sel.register(up_sock, selectors.EVENT_READ, "upstream")
        waiting[up_sock] = _Upstream(guest, client, query, ident, time.monotonic() + DNS_UPSTREAM_TIMEOUT)
        guest.pending += 1

    def _reply(self, sel: selectors.BaseSelector, up_sock: socket.socket,
               waiting: dict[socket.socket, _Upstream]) -> None:
        up = waiting[up_sock]
        while True:
            try:
                data = up_sock.recv(4096, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # refused (an ICMP error): no answer will come
                self._close_upstream(sel, up_sock, waiting)
                _send(up.guest, dnswire.error_reply(up.query.ident, up.query.flags, dnswire.SERVFAIL,
                                                    up.query.question), up.client)
                return
            reply = dnswire.upstream_reply(data, up.ident, up.query)
            if reply is not None:
                self._close_upstream(sel, up_sock, waiting)
                _send(up.guest, reply, up.client)
                return

    @staticmethod
    def _close_upstream(sel: selectors.BaseSelector, up_sock: socket.socket,
                        waiting: dict[socket.socket, _Upstream]) -> _Upstream:
        up = waiting.pop(up_sock)
        up.guest.pending -= 1
        sel.unregister(up_sock)
        up_sock.close()
        return up


def _recvfrom(sock: socket.socket) -> tuple[bytes, tuple[str, int]] | None:
    try:
        data, client = sock.recvfrom(dnswire.MAX_QUERY + 1, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return None  # an ICMP error queued by an earlier reply: nothing to read
    return data, client


def _recv(sock: socket.socket, size: int) -> bytes | None:
    try:
        return sock.recv(size, socket.MSG_DONTWAIT)
    except OSError:
        return None


def _send(guest: GuestDns, data: bytes, client: tuple[str, int]) -> None:
    try:
        guest.sock.sendto(data, socket.MSG_DONTWAIT, client)
    except OSError:
        pass  # the guest's client is gone or its buffer full: as a lost datagram would be


PROXY = _Proxy()


def serve(sock_fd: int, upstream: tuple[str, int] | None, names: Mapping[str, list[str]] | None) -> GuestDns:
    """Serve the guest socket ``sock_fd`` (now the proxy's): ``names`` None forwards every name to
    ``upstream``; a mapping answers those names only, from their addresses."""
    guest = GuestDns(socket.socket(fileno=sock_fd), upstream, names)
    PROXY.add(guest)
    return guest


def stop(guest: GuestDns) -> None:
    PROXY.remove(guest)

