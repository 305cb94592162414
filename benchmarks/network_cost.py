"""The cost of a namespace guest with the network on (pasta NAT) against one without.

Usage: python benchmarks/network_cost.py [N]   (root; needs pasta). Prints the median create +
first exec + destroy time for each setting and their ratio, and the DNS proxy's share of the
networked guest's time (serving its socket, pointing its /etc/resolv.conf at it, stopping it),
timed around those calls in the same guests. Makes its own state dir.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.backends.namespace import dns
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.backends.namespace.guest import NamespaceGuest
from pytest_smolvm.baselines.baseline import resolve

PROXY_SECONDS: list[float] = []  # time inside the proxy's per-guest calls, one entry per call


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PROXY_SECONDS.append(time.perf_counter() - start)
    return run


def _time_the_proxy() -> None:
    """The proxy's per-guest work, timed where it happens: ``serve`` and ``stop`` of its socket,
    and the one ``write_file`` create makes (the guest's /etc/resolv.conf)."""
    dns.serve = _timed(dns.serve)
    dns.stop = _timed(dns.stop)
    NamespaceGuest.write_file = _timed(NamespaceGuest.write_file)  # type: ignore[method-assign]


def one(backend: NamespaceBackend, network: bool, baseline: object) -> float:
    start = time.perf_counter()
    guest = backend.create(VMSpec(name=f"bench-{uuid.uuid4().hex[:10]}", baseline=baseline,  # type: ignore[arg-type]
                                  network=network))
    try:
        guest.exec(["true"], env={}, workdir=None, stdin=None, timeout=30, output_limit=1 << 20)
    finally:
        guest.destroy()
    return time.perf_counter() - start


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with tempfile.TemporaryDirectory(prefix="smolvm-netbench-") as state:
        os.environ["PYTEST_SMOLVM_STATE_DIR"] = state
        backend = NamespaceBackend()
        try:
            baseline = resolve(None, Path.cwd())
            backend.rootfs(baseline)
            one(backend, False, baseline)
            one(backend, True, baseline)  # warm both paths once
            times: dict[bool, list[float]] = {False: [], True: []}
            _time_the_proxy()
            for _ in range(n):  # interleaved, so drift in host load hits both alike
                for network in (False, True):
                    times[network].append(one(backend, network, baseline))
        finally:
            backend.close()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"network off: median {off * 1000:.1f} ms per guest (create + exec + destroy), n={n}")
    print(f"network on:  median {on * 1000:.1f} ms per guest, n={n}")
    print(f"ratio on/off: {on / off:.2f}x (+{(on - off) * 1000:.1f} ms)")
    proxy = sum(PROXY_SECONDS) / n
    print(f"DNS proxy: {proxy * 1000:.2f} ms per networked guest (mean), "
          f"{proxy / statistics.mean(times[True]) * 100:.1f}% of its mean time; ratio on/off without it: "
          f"{(statistics.mean(times[True]) - proxy) / statistics.mean(times[False]):.2f}x")


if __name__ == "__main__":
    main()
