"""The cost of checking a cached baseline against its manifest, against the unpack it guards.

    python benchmarks/cache_check.py [--rounds N]

Unpacks the bundled baseline into a fresh cache dir (the floor: what a damaged tree costs to
make again), then times, best of N each: writing the manifest (paid once, at unpack), the cheap
check a process makes the first time it uses the tree (one lstat per entry), the same check
where every file's stamps changed (a restored cache: every file hashed once, then cheap again),
and the full verification ``pytest-smolvm doctor`` runs. Prints each and its ratio to the unpack.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def _best(work: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    os.environ["PYTEST_SMOLVM_CACHE_DIR"] = tempfile.mkdtemp(prefix="smolvm-cache-check-")
    from pytest_smolvm.baselines import cache, manifest
    from pytest_smolvm.baselines.baseline import resolve

    baseline = resolve(None, Path.cwd())
    started = time.perf_counter()
    tree = cache.unpack(baseline).path.parent
    unpack = time.perf_counter() - started
    entries = manifest.load(tree) or []

    def stale() -> None:  # every stamp off: as after restoring the cache from an archive
        for entry in entries:
            if "t" in entry:
                entry["t"] = [0, 0, 0]
        manifest._save(tree, entries)
        manifest.check(tree)

    figures = {"write (at unpack)": _best(lambda: manifest.write(tree), args.rounds),
               "cheap check (first use per process)": _best(lambda: manifest.check(tree), args.rounds),
               "check of a restored cache (every file hashed)": _best(stale, args.rounds),
               "full verify (doctor)": _best(lambda: manifest.verify(tree), args.rounds)}
    print(f"{baseline.reference}: {len(entries)} entries; unpack (the floor) {unpack * 1000:.1f} ms")
    for what, seconds in figures.items():
        print(f"  {what}: {seconds * 1000:.2f} ms = {seconds / unpack:.3f}x the unpack")
    cache.force_rmtree(Path(os.environ["PYTEST_SMOLVM_CACHE_DIR"]))


if __name__ == "__main__":
    main()
