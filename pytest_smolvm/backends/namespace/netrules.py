"""The nftables rules a networked namespace guest is fenced and recorded by (``network`` loads them).

Two tables: the fence, in the host's namespace, matching pasta's packets by its group; and the
guest's own, in its network namespace (the guest half of the egress ledger, its fast refusals,
the ports its flows leave from and what may come back in). Both are bounded per guest.
"""

from __future__ import annotations

from pathlib import Path

from pytest_smolvm.errors import ProvisionError

# The clouds' metadata services: AWS/GCP/Azure/OCI (169.254.169.254, and the rest of the
# link-local range), Azure's WireServer, Alibaba's. fd00:ec2::254 (AWS over IPv6) is refused
# with all of IPv6 by the host's table.
METADATA = ("169.254.0.0/16", "168.63.129.16/32", "100.100.100.200/32")
LEDGER_TABLE = "smolvm_egress"
LEDGER_ENTRIES = 256  # destinations kept per set (the guest's two, the host's one); more are counted
MORE = "(more destinations)"  # the ledger row of the flows past LEDGER_ENTRIES, with their count


def ledger_rules(ports: str) -> str:
    """The guest's own table, loaded into its network namespace (the guest has no CAP_NET_ADMIN
    there: it can neither read nor change it).

    The guest half of the egress ledger and its fast refusals: refused destinations are routed
    to the guest's loopback, where no address of theirs is local, so the routes alone refuse
    them (a timeout); ``out`` records each new flow to them and answers it at once (a TCP reset,
    an ICMP error for UDP), and records each new flow that leaves through pasta. The sets are
    bounded: a new destination past LEDGER_ENTRIES fails the set's update, which ends that rule,
    and the next one counts it (the guest cannot make the host keep more).

    pasta binds a host socket to the source port of each UDP flow it carries, as root (a TCP
    flow gets a port of the host kernel's choosing: checked): the chain ``ports`` makes the
    guest's UDP flows leave from a port of ``ports`` (the host's ephemeral range, from
    :func:`flow_ports`), never one a host service could want, and ``inbound`` lets in through
    pasta only answers to a flow of the guest's (from the peer that flow went to), not whatever
    else reaches pasta's socket."""
    return f"""
table inet smolvm_egress {{
  set refused {{ type ipv4_addr . inet_proto . inet_service; flags dynamic; size {LEDGER_ENTRIES}; counter; }}
  set allowed {{ type ipv4_addr . inet_proto . inet_service; flags dynamic; size {LEDGER_ENTRIES}; counter; }}
  counter more_refused {{ }}
  counter more_allowed {{ }}
  chain out {{
    type filter hook output priority 0; policy accept;
    ct state != new accept
    meta l4proto != {{ tcp, udp }} accept
    fib daddr type local accept
    oifname "lo" update @refused {{ ip daddr . meta l4proto . th dport }} goto refuse
    oifname "lo" counter name more_refused goto refuse
    update @allowed {{ ip daddr . meta l4proto . th dport }} accept
    counter name more_allowed accept
  }}
  chain refuse {{
    meta l4proto tcp reject with tcp reset
    reject
  }}
  chain ports {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname != "lo" meta l4proto udp masquerade to :{ports} random
  }}
  chain inbound {{
    type filter hook input priority 0; policy accept;
    iifname "lo" accept
    ct state {{ established, related }} accept
    drop
  }}
}}
"""


# The fence, in the host's namespace: every packet of pasta's sockets (its gid, {gid}) to a
# destination local to the host at that moment, or to a metadata address, or over IPv6, is
# refused and recorded. Sockets that are not full sockets (time-wait) have no gid: the match
# fails and the packet passes, as it does for every other process of the host. "create" fails if
# the table is there already (one left by a guest whose watcher was killed, whose init had this
# pid): start_nat removes it and loads again (an add-and-delete in every load costs ~13 ms).
FENCE_RULES = """
create table inet {table}
table inet {table} {{
  set refused {{ type ipv4_addr . inet_proto . inet_service; flags dynamic; size {entries}; counter; }}
  counter more_refused {{ }}
  chain out {{
    type filter hook output priority 0; policy accept;
    meta skgid {gid} goto fence
  }}
  chain fence {{
    fib daddr type {{ local, broadcast, multicast, anycast }} goto refuse
    ip daddr {{ {metadata} }} goto refuse
    meta nfproto ipv6 goto refuse
  }}
  chain refuse {{
    meta l4proto {{ tcp, udp }} update @refused {{ ip daddr . meta l4proto . th dport }} goto deny
    counter name more_refused goto deny
  }}
  chain deny {{
    meta l4proto tcp reject with tcp reset
    reject
  }}
}}
"""


def flow_ports(proc: Path = Path("/proc/sys/net/ipv4")) -> str:
    """The host ports a guest's flows may leave pasta from, as nftables writes a range: the host's
    ephemeral range (what its kernel hands any process), less its reserved ports (kept for
    services): the longest run of it they leave."""
    low, high = map(int, (proc / "ip_local_port_range").read_text().split())
    reserved: set[int] = set()
    for part in (proc / "ip_local_reserved_ports").read_text().strip().split(","):
        if part:
            first, _, last = part.partition("-")
            reserved.update(range(int(first), int(last or first) + 1))
    best, start = (low, low - 1), low
    for port in range(low, high + 2):
        if port > high or port in reserved:
            if port - start > best[1] - best[0] + 1:
                best = (start, port - 1)
            start = port + 1
    if best[1] < best[0]:
        raise ProvisionError(f"network=True: every port of the host's ephemeral range ({low}-{high}) is "
                             f"reserved (net.ipv4.ip_local_reserved_ports): no port is left for a guest's flows")
    return f"{best[0]}-{best[1]}"
