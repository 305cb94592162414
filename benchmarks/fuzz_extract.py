"""The long run of the extraction fuzzer (tests/security/test_fuzz_extract.py runs a short one).

``python benchmarks/fuzz_extract.py [--cases N] [--wall in-process|confined|both]``: N Hypothesis
cases per (wall, policy), each checked by ``tests.tarfuzz.check`` (inside the destination or
UnsafeArchive; the canary beside it untouched; bounded memory). Prints, per pair, the count of
cases, how many unpacked and how many were refused, cases/s, and the ratio of its time per case
to a raw baseline measured in the same run on the same streams: ``tarfile`` listing them
(``getmembers``, no extraction). A failing case stops the run with its reproduction blob.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, given, settings

from tests.tarfuzz import POLICIES, Case, cases, check, write


def raw_listing(data: bytes) -> None:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.getmembers()
    except (tarfile.TarError, ValueError, OverflowError, UnicodeError):
        pass


def run(wall: str, policy: str, count: int) -> tuple[Counter[str], float, float]:
    outcomes: Counter[str] = Counter()
    spent = [0.0, 0.0]  # (checked, raw baseline)

    @settings(max_examples=count, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def fuzz(case: Case) -> None:
        began = time.perf_counter()
        outcomes[check(case, wall, policy)] += 1
        spent[0] += time.perf_counter() - began
        data = write(case, Path("/nonexistent/canary"))
        began = time.perf_counter()
        raw_listing(data)
        spent[1] += time.perf_counter() - began

    fuzz()
    return outcomes, spent[0], spent[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000, help="cases per (wall, policy) (default 2000)")
    parser.add_argument("--wall", choices=["in-process", "confined", "both"], default="both")
    args = parser.parse_args()
    walls = ["in-process", "confined"] if args.wall == "both" else [args.wall]
    total = 0
    began = time.perf_counter()
    for wall in walls:
        for policy in sorted(POLICIES):
            outcomes, checked, raw = run(wall, policy, args.cases)
            n = sum(outcomes.values())
            total += n
            print(f"{wall:10} {policy:8} cases={n:6} unpacked={outcomes['ok']:5} refused={outcomes['refused']:5} "
                  f"cases/s={n / checked:7.1f}  x raw tarfile listing: {checked / max(raw, 1e-9):6.0f}", flush=True)
    elapsed = time.perf_counter() - began
    print(f"total: {total} cases in {elapsed:.0f}s ({total / elapsed:.1f} cases/s), no property broken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
