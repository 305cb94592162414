"""A networked namespace guest's egress ledger: what it tried to reach, read from its two halves.

The guest half is the nftables table in the guest's own network namespace (every new flow,
allowed or refused by its routes); the host half is its fence's table in the host's namespace
(every packet of pasta's the fence refused). Both are bounded (``netrules.LEDGER_ENTRIES`` per
set, then an overflow counter): reading them is linear in a size the guest cannot raise.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import subprocess

from pytest_smolvm.backends.base import EgressAttempt
from pytest_smolvm.backends.namespace.netrules import LEDGER_TABLE, MORE
from pytest_smolvm.backends.namespace.network import Nat, in_netns, nft_path
from pytest_smolvm.errors import ProvisionError
from pytest_smolvm.inert import inert

LEDGER_ROWS = 200  # destinations shown in a guest's log; the counts cover them all


def read_ledger(namespaces: dict[str, int], nat: Nat | None) -> list[EgressAttempt]:
    """What the guest tried to reach so far, most connections first: the guest's two sets, with
    the destinations the host's fence refused (by then or later) marked refused."""
    out = in_netns(namespaces["net"], namespaces.get("user", -1),
                    [str(nft_path()), "-j", "list", "table", "inet", LEDGER_TABLE], "")
    rows = _ledger_rows(out)
    if nat is not None:
        host = subprocess.run([str(nft_path()), "-j", "list", "table", "inet", nat.table],
                              capture_output=True, text=True, check=False)
        if host.returncode:
            raise ProvisionError(f"the egress fence's table is gone: {' '.join(host.stderr.split())[:300]}")
        fenced = {(a.address, a.protocol, a.port): a for a in _ledger_rows(host.stdout, fence=True)}
        for i, row in enumerate(rows):
            if row.allowed and fenced.pop((row.address, row.protocol, row.port), None) is not None:
                rows[i] = dataclasses.replace(row, allowed=False)
        # What is left the host refused after the guest's own set was full: those flows were
        # counted on the guest's "more" row as passed to the host; count them once, as refused.
        rows += fenced.values()
        passed = sum(a.connections for a in fenced.values())
        rows = [dataclasses.replace(a, connections=a.connections - passed)
                if a.address == MORE and a.allowed else a for a in rows]
        more = sum(a.connections for a in rows if a.address == MORE and not a.allowed)
        rows = [a for a in rows if a.address != MORE or (a.allowed and a.connections > 0)]
        if more:
            rows.append(EgressAttempt(MORE, "tcp/udp", 0, False, more))
    return sorted(rows, key=lambda a: (-a.connections, a.address, a.port))


def _ledger_rows(listing: str, fence: bool = False) -> list[EgressAttempt]:
    """The rows of one ``nft -j list table``: each set's elements, each overflow counter's count."""
    found: list[EgressAttempt] = []
    for entry in json.loads(listing).get("nftables", []):
        if not isinstance(entry, dict):
            continue
        counter = entry.get("counter")
        if isinstance(counter, dict) and str(counter.get("name", "")).startswith("more_"):
            packets = int(counter.get("packets", 0))
            if packets:
                found.append(EgressAttempt(MORE, "tcp/udp", 0, counter["name"] == "more_allowed", packets))
            continue
        found_set = entry.get("set")
        if not isinstance(found_set, dict) or found_set.get("name") not in ("allowed", "refused"):
            continue
        for element in found_set.get("elem") or []:
            try:
                inner = element["elem"]
                address, protocol, port = inner["val"]["concat"]
                count = int(inner.get("counter", {}).get("packets", 0))
                found.append(EgressAttempt(str(ipaddress.IPv4Address(address)), str(protocol), int(port),
                                           found_set["name"] == "allowed" and not fence, count))
            except (KeyError, TypeError, ValueError):
                continue  # a shape this nft does not write: skipped, never a crash at teardown
    return found


def render_ledger(rows: list[EgressAttempt]) -> str:
    attempts = [a for a in rows if a.protocol != "dns"]
    names = [a for a in rows if a.protocol == "dns"]
    if not attempts and not names:
        return "egress: the guest attempted no connection and asked DNS for no name"
    lines = [f"egress ledger ({sum(1 for a in attempts if a.address != MORE)} destination(s), "
             f"{sum(a.connections for a in attempts if not a.allowed)} refused connection(s)):"]
    more = [a for a in attempts if a.address == MORE]  # first: past the bound, these are all there is
    listed = [a for a in attempts if a.address != MORE]
    lines += [f"  {a.render()}" for a in [*more, *listed[:LEDGER_ROWS]]]
    if len(listed) > LEDGER_ROWS:
        lines.append(f"  ... {len(listed) - LEDGER_ROWS} more")
    if names:
        lines.append(f"dns names asked ({len(names)} name(s), {sum(1 for a in names if not a.allowed)} refused):")
        lines += [f"  {inert(a.render())}" for a in names[:LEDGER_ROWS]]  # escaped already; twice is cheap
        if len(names) > LEDGER_ROWS:
            lines.append(f"  ... {len(names) - LEDGER_ROWS} more")
    return "\n".join(lines)
