"""The cost of a namespace guest with the network on (pasta NAT) against one without.

Usage: python benchmarks/network_cost.py [N]   (root; needs pasta). Prints the median create +
first exec + destroy time for each setting and their ratio. Makes its own state dir.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.baselines.baseline import resolve


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
            for _ in range(n):  # interleaved, so drift in host load hits both alike
                for network in (False, True):
                    times[network].append(one(backend, network, baseline))
        finally:
            backend.close()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"network off: median {off * 1000:.1f} ms per guest (create + exec + destroy), n={n}")
    print(f"network on:  median {on * 1000:.1f} ms per guest, n={n}")
    print(f"ratio on/off: {on / off:.2f}x (+{(on - off) * 1000:.1f} ms)")


if __name__ == "__main__":
    main()
