"""User-mode NAT for a namespace guest that asked for the network (``network=True``).

The guest always has a network namespace of its own. For ``network=True`` the host attaches
pasta (Debian package ``passt``) to it: pasta gives the namespace a tap interface and carries
its TCP/UDP out through ordinary sockets of the host. pasta over slirp4netns: it is in Debian 12,
needs no setuid helper, and can be told to map nothing of the host into the guest
(``--no-map-gw``, ``-T none -U none``: the gateway address and the guest's loopback ports are
otherwise forwarded to the host's loopback).

What pasta alone would still let through, the guest's own routing table refuses: routes to the
guest's loopback (where none of those addresses is local) for 169.254.0.0/16 (cloud metadata)
and for each of the host's own addresses, set from the host before the guest runs anything; an
nftables chain in the guest's namespace records every new flow (the egress ledger) and answers
those to refused addresses at once. The guest has no CAP_NET_ADMIN, so it can remove neither.
IPv4 only (``-4``): no IPv6 routes means no fe80::/10 either.

pasta's lifetime is bound to the guest's init by a watcher process: when the init exits (destroy,
or the owning pytest died and the init saw its socket close), the watcher kills pasta.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pytest_smolvm import limits
from pytest_smolvm.backends.base import EgressAttempt
from pytest_smolvm.errors import ProvisionError
from pytest_smolvm.inert import inert

INSTALL_HINT = ("network=True on the namespace backend needs pasta, nftables and iproute2: "
                "apt-get install -y passt nftables iproute2")
PROHIBITED = ("169.254.0.0/16",)
SBIN = ("/usr/sbin", "/sbin")  # nft and ip live here, often off a normal user's PATH
LEDGER_TABLE = "smolvm_egress"
LEDGER_ROWS = 200  # destinations shown in a guest's log; the counts cover them all
# The guest's egress ledger and its fast refusals, loaded into its own network namespace (the
# guest has no CAP_NET_ADMIN there: it can neither read nor change them). Refused destinations
# are routed to the guest's loopback, where no address of theirs is local: the routes alone
# refuse them (a timeout); this chain records each new flow to them and answers it at once
# (a TCP reset, an ICMP error for UDP), and records each new flow that leaves through pasta.
LEDGER_RULES = """
table inet smolvm_egress {
  set refused { type ipv4_addr . inet_proto . inet_service; flags dynamic; size 65536; counter; }
  set allowed { type ipv4_addr . inet_proto . inet_service; flags dynamic; size 65536; counter; }
  chain out {
    type filter hook output priority 0; policy accept;
    ct state != new accept
    meta l4proto != { tcp, udp } accept
    fib daddr type local accept
    oifname "lo" update @refused { ip daddr . meta l4proto . th dport } meta l4proto tcp reject with tcp reset
    oifname "lo" reject
    update @allowed { ip daddr . meta l4proto . th dport }
  }
}
"""

# Runs as its own process: starts pasta (argv[3:]) with the guest's namespace fds (argv[2]) and
# kills it once the guest's init (argv[1]) or pasta itself is gone. pidfds: a recycled pid
# cannot fool it. SIGTERM is ignored so that a terminal's ^C kills pasta through the init only.
_WATCHER = """
import os, select, signal, subprocess, sys
signal.pthread_sigmask(signal.SIG_SETMASK, ())  # pasta gets no mask from the host thread that started us
signal.signal(signal.SIGINT, signal.SIG_IGN)
init = os.pidfd_open(int(sys.argv[1]))
p = subprocess.Popen(sys.argv[3:], pass_fds=[int(f) for f in sys.argv[2].split(",")], stdin=subprocess.DEVNULL)
select.select([init, os.pidfd_open(p.pid)], [], [])
p.kill()
p.wait()
"""


def pasta() -> str:
    """pasta's path; also checks for nft (the ledger and the fence's fast refusals) and ip (the
    host's addresses to refuse, the guest's routes): without one, no guest with a network."""
    found = shutil.which("pasta")
    if found is None or _nft() is None or _sbin_tool("ip") is None:
        raise ProvisionError(INSTALL_HINT)
    return found


def _sbin_tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def _nft() -> str | None:
    return _sbin_tool("nft")


def _ip() -> str:
    found = _sbin_tool("ip")
    if found is None:  # fail closed: without the host's addresses nothing of the host is refused
        raise ProvisionError(INSTALL_HINT)
    return found


def host_addresses() -> list[str]:
    """The host's own IPv4 addresses (every interface), to be refused inside the guest."""
    out = subprocess.run([_ip(), "-4", "-o", "addr", "show"], capture_output=True, text=True, check=False).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            addr = fields[fields.index("inet") + 1].split("/")[0]
            if not ipaddress.ip_address(addr).is_loopback and addr not in found:
                found.append(addr)  # once: two interfaces may share one, and a second route would fail
    return found


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
    ctl.settimeout(limits.LIMITS.network_ready)
    try:
        data, fds, _flags, _addr = socket.recv_fds(ctl, 4096, 3)
    except OSError as exc:
        raise ProvisionError(f"namespace guest {name}: its namespaces never came for the network: {exc}") from None
    finally:
        ctl.settimeout(None)
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
              allowed: list[ipaddress.IPv4Network] | None = None) -> subprocess.Popen[bytes]:
    """Attach pasta to the guest's network namespace, fence off the host and start the ledger;
    the watcher process. ``namespaces`` (from :func:`receive_namespaces`) stay the caller's."""
    netns = namespaces["net"]
    # User-namespace mode: the guest's netns belongs to its user namespace, which this user
    # owns; joining that user namespace first is what gives CAP_NET_ADMIN there.
    userns = namespaces.get("user", -1)
    binary = pasta()
    fds = (netns,) if userns < 0 else (netns, userns)
    pidfile = scratch / "pasta.pid"
    # Fence first: the guest runs nothing before create returns, and the routes do not
    # depend on the interface pasta makes.
    prefixes = [*PROHIBITED, *(f"{a}/32" for a in host_addresses())]
    _ip_in(netns, userns, "link set lo up\n" + "".join(f"route replace {p} dev lo\n" for p in prefixes))
    _in_netns(netns, userns, [str(_nft()), "-f", "-"], LEDGER_RULES)
    # As root pasta would switch to nobody and could no longer join the namespace;
    # --runas 0 keeps it root in name, it drops its capabilities and sandboxes itself.
    who = ["--runas", "0"] if userns < 0 else ["--userns", f"/proc/self/fd/{userns}"]
    argv = [binary, "-f", "-q", "-4", *who, "--config-net", "--no-map-gw",
            "-t", "none", "-u", "none", "-T", "none", "-U", "none", "-P", str(pidfile),
            "--netns", f"/proc/self/fd/{netns}"]
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(init_pid), ",".join(map(str, fds)), *argv],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, pass_fds=fds, start_new_session=True)
    deadline = time.monotonic() + limits.LIMITS.network_ready
    while not pidfile.exists():
        if watcher.poll() is not None or time.monotonic() > deadline:
            err = watcher.stderr.read().decode(errors="replace") if watcher.stderr else ""
            stop_nat(watcher)
            pidfile.unlink(missing_ok=True)
            raise ProvisionError(f"pasta did not start: {' '.join(err.split())[:300] or 'no message'}")
        time.sleep(0.005)
    pidfile.unlink()  # the scratch dir must be empty for the guest's removal
    if allowed is not None:
        try:
            _allow_only(netns, userns, allowed)
        except BaseException:
            stop_nat(watcher)
            raise
    return watcher


def _allow_only(netns: int, userns: int, allowed: list[ipaddress.IPv4Network]) -> None:
    """Refuse every address but ``allowed``: two /1 routes to the loopback beat pasta's default
    route, a route per allowed network (more specific) goes through pasta's gateway. The host's
    own addresses and 169.254.0.0/16 stay refused: their /32 beats any allowed network, and an
    allowed /32 equal to one of them is left out."""
    probe = _ip_in(netns, userns, "route show default\n").split()  # IPv4: ip route's default family
    if "via" not in probe or "dev" not in probe:
        raise ProvisionError(f"allow_hosts: pasta gave the guest no default route ({' '.join(probe)!r})")
    gateway, dev = probe[probe.index("via") + 1], probe[probe.index("dev") + 1]
    fenced = {ipaddress.IPv4Network(p) for p in PROHIBITED} | {
        ipaddress.IPv4Network(f"{a}/32") for a in host_addresses()}
    batch = "route add 0.0.0.0/1 dev lo\nroute add 128.0.0.0/1 dev lo\n"
    for net in sorted(set(allowed) - fenced):
        batch += f"route add {net} via {gateway} dev {dev} onlink\n"
    _ip_in(netns, userns, batch)


def stop_nat(watcher: subprocess.Popen[bytes]) -> None:
    """Stop pasta and its watcher now (they share a process group of their own) and reap the watcher."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(watcher.pid, signal.SIGKILL)
    watcher.wait()
    if watcher.stderr:
        watcher.stderr.close()


def _ip_in(netns: int, userns: int, batch: str) -> str:
    """Run ``ip -batch`` in the guest's network namespace: one process for all the commands."""
    return _in_netns(netns, userns, [_ip(), "-batch", "-"], batch)


def _in_netns(netns: int, userns: int, argv: list[str], stdin: str) -> str:
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


def read_ledger(namespaces: dict[str, int]) -> list[EgressAttempt]:
    """What the guest tried to reach so far: the ledger's two sets, most connections first."""
    out = _in_netns(namespaces["net"], namespaces.get("user", -1),
                    [str(_nft()), "-j", "list", "table", "inet", LEDGER_TABLE], "")
    found: list[EgressAttempt] = []
    for entry in json.loads(out).get("nftables", []):
        found_set = entry.get("set") if isinstance(entry, dict) else None
        if not isinstance(found_set, dict) or found_set.get("name") not in ("allowed", "refused"):
            continue
        for element in found_set.get("elem") or []:
            try:
                inner = element["elem"]
                address, protocol, port = inner["val"]["concat"]
                count = int(inner.get("counter", {}).get("packets", 0))
                found.append(EgressAttempt(str(ipaddress.IPv4Address(address)), str(protocol), int(port),
                                           found_set["name"] == "allowed", count))
            except (KeyError, TypeError, ValueError):
                continue  # a shape this nft does not write: skipped, never a crash at teardown
    return sorted(found, key=lambda a: (-a.connections, a.address, a.port))


def render_ledger(rows: list[EgressAttempt]) -> str:
    attempts = [a for a in rows if a.protocol != "dns"]
    names = [a for a in rows if a.protocol == "dns"]
    if not attempts and not names:
        return "egress: the guest attempted no connection and asked DNS for no name"
    lines = [f"egress ledger ({len(attempts)} destination(s), "
             f"{sum(a.connections for a in attempts if not a.allowed)} refused connection(s)):"]
    lines += [f"  {a.render()}" for a in attempts[:LEDGER_ROWS]]
    if len(attempts) > LEDGER_ROWS:
        lines.append(f"  ... {len(attempts) - LEDGER_ROWS} more")
    if names:
        lines.append(f"dns names asked ({len(names)} name(s), {sum(1 for a in names if not a.allowed)} refused):")
        lines += [f"  {inert(a.render())}" for a in names[:LEDGER_ROWS]]  # escaped already; twice is cheap
        if len(names) > LEDGER_ROWS:
            lines.append(f"  ... {len(names) - LEDGER_ROWS} more")
    return "\n".join(lines)
