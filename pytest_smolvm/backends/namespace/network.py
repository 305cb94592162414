"""User-mode NAT for a namespace guest that asked for the network (``network=True``).

The guest always has a network namespace of its own. For ``network=True`` the host attaches
pasta (Debian package ``passt``) to it: pasta gives the namespace a tap interface and carries
its TCP/UDP out through ordinary sockets of the host. pasta over slirp4netns: it is in Debian 12,
needs no setuid helper, and can be told to map nothing of the host into the guest
(``--no-map-gw``, ``-T none -U none``: the gateway address and the guest's loopback ports are
otherwise forwarded to the host's loopback).

The fence is a rule evaluated per packet on the host, not a list taken at creation: pasta runs
with a group id of its own (``FENCE_GID_BASE`` + the guest init's pid; uid 0 in name, its
capabilities dropped by itself), so every packet of its sockets carries that gid, and an nftables
table in the host's namespace (``smolvm_fence_<pid>``, loaded before pasta starts) matches it
(``meta skgid``) on the output hook and refuses, at the time of each packet, every destination
local to the host (``fib daddr type { local, broadcast, multicast, anycast }``: addresses and local
routes the host gains later, its loopback, broadcast and multicast, the sockets of other guests'
pasta, which are local to the host) and the clouds' metadata addresses (``METADATA``). Its refusals
go into a bounded set of that table: the host half of the guest's ledger. Only root can write
the host's nftables, so a normal user's guest (user-namespace mode) gets no network: it fails
with one line rather than run unfenced.

In the guest's own namespace, where the guest has no CAP_NET_ADMIN, routes to its loopback refuse
the metadata addresses at once and, for ``allow_hosts``, everything outside the list; an
nftables chain there records every new flow (the guest half of the ledger) and answers those to
refused addresses at once; the same table gives every UDP flow leaving through pasta a source
port of the host's ephemeral range (pasta binds the flow's own port on the host, as root) and
lets in through pasta only answers to the guest's flows. The allowlist only narrows what the
host's table lets through: no CIDR, 0.0.0.0/0 included, reaches past it. IPv4 only (``-4``);
the host's table refuses IPv6 too. Every part of this that fails to be set up is a
ProvisionError: the guest does not start.

The host's table is loaded before pasta starts (while the guest's own routes go in). pasta's
lifetime is bound to the guest's init by a watcher process: when the init exits (destroy, or the
owning pytest died and the init saw its socket close) or destroy tells it, the watcher kills
pasta and removes the host's table; destroy does not wait for that (nftables' commit of a
removal costs ~10 ms), the watcher is reaped later, at exit at the latest.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pytest_smolvm import limits
from pytest_smolvm.backends.namespace.channel import receive_fds
from pytest_smolvm.backends.namespace.netrules import FENCE_RULES, LEDGER_ENTRIES, METADATA, flow_ports, ledger_rules
from pytest_smolvm.errors import ProvisionError

INSTALL_HINT = ("network=True on the namespace backend needs pasta, nftables and iproute2: "
                "apt-get install -y passt nftables iproute2")
NEEDS_ROOT = ("network=True and allow_hosts on the namespace backend need root: the egress fence is a rule in the "
              "host's nftables, which a normal user cannot load (run as root, or use --smol-backend=smol)")
FENCE_GID_BASE = 2_000_000_000  # + the guest init's pid (at most 2**22): pasta's group, matched on the host
FENCE_TABLE = "smolvm_fence_"  # + the guest init's pid: its table in the host's namespace
SBIN = ("/usr/sbin", "/sbin")  # nft and ip live here, often off a normal user's PATH
# Runs as its own process: starts pasta (argv[6:]) in the fence's group (argv[3]) with the
# guest's namespace fds (argv[2]); once the guest's init (argv[1]) or pasta is gone, or on SIGTERM
# (the guest's destroy), kills pasta and removes the fence's table (argv[5]) from the host with nft
# (argv[4]): whatever killed pytest, nothing of the guest's is left on the host, and destroy need
# not wait for nftables' commit. pidfds: a recycled pid cannot fool it. SIGINT is ignored so
# that a terminal's ^C kills pasta through the init only.
_WATCHER = """
import os, select, signal, subprocess, sys
# SIGTERM only wakes the select below (through the wakeup fd): raised as an exception it could
# land inside Popen, after pasta was forked and before it was ours to kill.
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGTERM, lambda *_: None)
signal.pthread_sigmask(signal.SIG_SETMASK, ())  # pasta gets no mask from the host thread that started us
signal.signal(signal.SIGINT, signal.SIG_IGN)
init = os.pidfd_open(int(sys.argv[1]))
pasta = subprocess.Popen(sys.argv[6:], pass_fds=[int(f) for f in sys.argv[2].split(",")],
                         stdin=subprocess.DEVNULL, group=int(sys.argv[3]), extra_groups=[])
select.select([init, os.pidfd_open(pasta.pid), wake_r], [], [])
pasta.kill()
pasta.wait()
subprocess.run([sys.argv[4], "delete", "table", "inet", sys.argv[5]], stdin=subprocess.DEVNULL, capture_output=True)
"""


@dataclasses.dataclass
class Nat:
    """A networked guest's pasta watcher and its fence's table in the host's namespace."""

    watcher: subprocess.Popen[bytes] | None
    table: str
    gid: int


_ENDING: list[Nat] = []  # guests destroyed whose watchers are still removing their fences
_ENDING_LOCK = threading.Lock()  # guests are destroyed from several threads at once


def pasta() -> str:
    """pasta's path; also checks for nft (the fence and the ledger need both), ip (the guest's
    routes) and for root (only root can load the fence into the host's nftables: a guest never
    runs unfenced)."""
    found = shutil.which("pasta")
    if found is None or nft_path() is None or _sbin_tool("ip") is None:
        raise ProvisionError(INSTALL_HINT)
    if os.geteuid() != 0:
        raise ProvisionError(NEEDS_ROOT)
    return found


def nft_path() -> str | None:
    return _sbin_tool("nft")


def _sbin_tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def allowed_networks(allow_hosts: tuple[str, ...]) -> tuple[list[ipaddress.IPv4Network], dict[str, list[str]]]:
    """``allow_hosts`` as IPv4 networks, and the names among them with their addresses.

    Names resolve here, once, on the host, when the guest is made; the guest gets them in its
    /etc/hosts and may reach those addresses only. A name whose address changes mid-test keeps
    the address it had at creation. A name or address that is not IPv4 is refused in one line.
    """
    nets: list[ipaddress.IPv4Network] = []
    names: dict[str, list[str]] = {}
    for entry in allow_hosts:
        try:
            net = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            try:
                found = socket.getaddrinfo(entry, None, socket.AF_INET, socket.SOCK_STREAM)
            except OSError as exc:
                raise ProvisionError(f"allow_hosts: {entry!r} does not resolve on the host: {exc}") from None
            addrs = sorted({str(info[4][0]) for info in found})
            names[entry] = addrs
            nets.extend(ipaddress.IPv4Network(f"{a}/32") for a in addrs)
            continue
        if not isinstance(net, ipaddress.IPv4Network):
            raise ProvisionError(f"allow_hosts: {entry!r}: the namespace backend's NAT is IPv4 only")
        nets.append(net)
    return nets, names


def receive_namespaces(ctl: socket.socket, name: str) -> dict[str, int]:
    """The guest's namespace fds its setup process sent on the control socket (``"net"``, and
    ``"user"`` in user-namespace mode, whose init no host process may open through /proc), and
    ``"dns"``: its DNS proxy's UDP socket, bound in its network namespace (backends/namespace/dns.py)."""
    data, fds = receive_fds(ctl, 3, f"namespace guest {name}: its namespaces never came for the network")
    try:
        names = json.loads(data)["namespaces"]
        if len(names) != len(fds) or not set(names) <= {"net", "user", "dns"} or "net" not in names:
            raise ValueError(names)
    except (ValueError, KeyError, TypeError):
        for fd in fds:
            os.close(fd)
        raise ProvisionError(f"namespace guest {name}: a malformed namespace message") from None
    return dict(zip(names, fds, strict=True))


def start_nat(init_pid: int, scratch: Path, namespaces: dict[str, int],
              allowed: list[ipaddress.IPv4Network] | None = None) -> Nat:
    """Fence the guest off on the host, start its ledger and attach pasta to its network
    namespace; the watcher process. ``namespaces`` (from :func:`receive_namespaces`) stay the caller's."""
    netns = namespaces["net"]
    # User-namespace mode: the guest's netns belongs to its user namespace, which this user
    # owns; joining that user namespace first is what gives CAP_NET_ADMIN there.
    userns = namespaces.get("user", -1)
    binary, nft = pasta(), str(nft_path())
    nat = Nat(watcher=None, table=f"{FENCE_TABLE}{init_pid}", gid=FENCE_GID_BASE + init_pid)
    fds = (netns,) if userns < 0 else (netns, userns)
    pidfile = scratch / "pasta.pid"
    rules = FENCE_RULES.format(table=nat.table, gid=nat.gid, entries=LEDGER_ENTRIES,
                               metadata=", ".join(m.removesuffix("/32") for m in METADATA))
    # As root pasta would switch to nobody and could no longer join the namespace; --runas 0
    # keeps it root in name (it drops its capabilities and sandboxes itself), in the fence's group.
    who = ["--runas", f"0:{nat.gid}"] if userns < 0 else ["--userns", f"/proc/self/fd/{userns}"]
    argv = [binary, "-f", "-q", "-4", *who, "--config-net", "--no-map-gw",
            "-t", "none", "-u", "none", "-T", "none", "-U", "none", "-P", str(pidfile),
            "--netns", f"/proc/self/fd/{netns}"]
    # The host's fence loads while the guest's own routes and ledger go in (they do not depend
    # on the interface pasta makes; the guest runs nothing before create returns); pasta starts
    # once it holds, so it never has a socket outside it.
    loader = subprocess.Popen([nft, "-f", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    try:
        if loader.stdin is not None:  # a ruleset of ~1 KiB: the pipe takes it whole, no wait
            with contextlib.suppress(BrokenPipeError), loader.stdin:  # it ended: its status says why
                loader.stdin.write(rules.encode())
        _ip_in(netns, userns, "link set lo up\n" + "".join(f"route replace {p} dev lo\n" for p in METADATA))
        in_netns(netns, userns, [nft, "-f", "-"], ledger_rules(flow_ports()))
        loader.wait(limits.LIMITS.network_ready)  # its stderr is a line or two: no pipe fills
    except BaseException as exc:
        loader.kill()
        loader.wait()
        _drop_fence(nft, nat.table)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise ProvisionError(f"the egress fence did not load into the host's nftables within "
                                 f"{limits.LIMITS.network_ready}s (so the guest does not start)") from None
        raise
    finally:
        said = loader.stderr.read().decode(errors="replace") if loader.stderr else ""
        if loader.stderr:
            loader.stderr.close()
    if loader.returncode and "File exists" in said:  # a stale table of this pid's: gone, and again
        _drop_fence(nft, nat.table)
        again = subprocess.run([nft, "-f", "-"], input=rules, capture_output=True, text=True, check=False)
        loader.returncode, said = again.returncode, again.stderr
    if loader.returncode:
        _drop_fence(nft, nat.table)
        raise ProvisionError(f"the egress fence could not be loaded into the host's nftables (so the guest "
                             f"does not start): {' '.join(said.split())[:300] or 'no message'}")
    try:
        nat.watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(init_pid), ",".join(map(str, fds)), str(nat.gid), nft, nat.table,
             *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=fds,
            start_new_session=True)
    except BaseException:
        _kill_nat(nat)
        raise
    deadline = time.monotonic() + limits.LIMITS.network_ready
    while not pidfile.exists():
        if nat.watcher.poll() is not None or time.monotonic() > deadline:
            _kill_nat(nat)
            said = nat.watcher.stderr.read().decode(errors="replace") if nat.watcher.stderr else ""
            if nat.watcher.stderr:
                nat.watcher.stderr.close()
            pidfile.unlink(missing_ok=True)
            raise ProvisionError(f"pasta did not start: {' '.join(said.split())[:300] or 'no message'}")
        time.sleep(0.005)
    pidfile.unlink()  # the scratch dir must be empty for the guest's removal
    if allowed is not None:
        try:
            _allow_only(netns, userns, allowed)
        except BaseException:
            _kill_nat(nat)
            raise
    return nat


def _drop_fence(nft: str, table: str) -> None:
    subprocess.run([nft, "delete", "table", "inet", table], stdin=subprocess.DEVNULL, capture_output=True,
                   check=False)  # absent already: the watcher removed it, or it was never loaded


def _allow_only(netns: int, userns: int, allowed: list[ipaddress.IPv4Network]) -> None:
    """Refuse every address but ``allowed`` in the guest's own namespace: two /1 routes to the
    loopback beat pasta's default route, a route per allowed network (more specific, or the same:
    ``replace``) goes through pasta's gateway; 0.0.0.0/0 is pasta's default route itself, with no
    /1 routes. The host's fence stands behind them whatever they let through."""
    probe = _ip_in(netns, userns, "route show default\n").split()  # IPv4: ip route's default family
    if "via" not in probe or "dev" not in probe:
        raise ProvisionError(f"allow_hosts: pasta gave the guest no default route ({' '.join(probe)!r})")
    gateway, dev = probe[probe.index("via") + 1], probe[probe.index("dev") + 1]
    everything = any(net.prefixlen == 0 for net in allowed)  # then the /1 routes would beat it
    batch = "" if everything else "route replace 0.0.0.0/1 dev lo\nroute replace 128.0.0.0/1 dev lo\n"
    for net in sorted(set(allowed)):
        batch += f"route replace {net} via {gateway} dev {dev} onlink\n"
    _ip_in(netns, userns, batch)


def stop_nat(nat: Nat) -> None:
    """The guest is going: tell its watcher to kill pasta and remove the fence's host table, and
    reap it (and earlier ones) once it has, without waiting here for nftables' commit."""
    if nat.watcher is not None:
        with contextlib.suppress(ProcessLookupError):
            nat.watcher.send_signal(signal.SIGTERM)  # ending already if the init is gone: its own way
        with _ENDING_LOCK:
            _ENDING.append(nat)
    _reap(block=False)


def _reap(block: bool) -> None:
    """Reap the watchers that have ended; with ``block`` (at exit), wait for each (at most the
    destroy limit) and end what is left of one that did not, as a failed create does."""
    with _ENDING_LOCK:
        ending = [n for n in _ENDING if block or (n.watcher is not None and n.watcher.poll() is not None)]
        for nat in ending:
            _ENDING.remove(nat)
    for nat in ending:
        assert nat.watcher is not None
        if block:
            with contextlib.suppress(subprocess.TimeoutExpired):
                nat.watcher.wait(limits.LIMITS.destroy_one_namespace_guest)
        if nat.watcher.poll() is None:  # it did not end: its group (pasta) and table go here
            _kill_nat(nat)
        if nat.watcher.stderr:
            nat.watcher.stderr.close()


atexit.register(_reap, True)


def _kill_nat(nat: Nat) -> None:
    """Kill the watcher's process group (pasta with it), reap the watcher and remove the
    fence's host table here: a guest that failed to be made, or a watcher that did not end."""
    watcher = nat.watcher
    if watcher is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(watcher.pid, signal.SIGKILL)
        watcher.wait()
    nft = nft_path()
    if nft is not None:
        _drop_fence(nft, nat.table)


def _ip_in(netns: int, userns: int, batch: str) -> str:
    """Run ``ip -batch`` in the guest's network namespace: one process for all the commands."""
    return in_netns(netns, userns, [_sbin_tool("ip") or "ip", "-batch", "-"], batch)


def in_netns(netns: int, userns: int, argv: list[str], stdin: str) -> str:
    """Run ``argv`` in the guest's network namespace (and, not as root, its user namespace)."""
    enter = [f"--net=/proc/self/fd/{netns}"]
    if userns >= 0:
        enter = [f"--user=/proc/self/fd/{userns}", "--preserve-credentials", *enter]
    done = subprocess.run(["nsenter", *enter, *argv], input=stdin,
                          pass_fds=(netns,) if userns < 0 else (netns, userns),
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise ProvisionError(f"{argv[0]} in the guest's network namespace: {' '.join(done.stderr.split())[:300]}")
    return done.stdout
