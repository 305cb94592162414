"""What a branch costs against a fresh guest, in one run (issue 45): ``python benchmarks/branch.py``.

Prints seconds (median of REPS) and ratios, each against its floor measured in the same run:

- ``branch`` of a parent with 0, 10 and 100 MB written, against a fresh guest (``Session.create``),
  and against the raw copy floor: the same bytes copied file to file (``copy_file_range``) in a
  directory of the runtime dir the parent's upper lives on, in the same run;
- ``branch_batch(8)`` against 8 ``branch()`` calls;
- ``reward("true")`` against ``exec("true")``.

Guests made ahead are turned off, so a fresh guest is made when it is asked for, as a branch is.
The namespace backend by default (``--backend smol`` where a microVM boots). The goal: a branch
of a parent with 100 MB written costs at most 2x a fresh guest on the namespace backend.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from pytest_smolvm import Session

REPS = 5


def median_seconds(action: Callable[[], object], reps: int = REPS) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def raw_copy_seconds(size: int) -> float:
    """The floor of a branch's copy: ``size`` bytes copied file to file on the runtime dir's
    filesystem (a tmpfs where XDG_RUNTIME_DIR is one, as it is for the guests' uppers)."""
    where = os.environ.get("XDG_RUNTIME_DIR") or "/dev/shm"
    with tempfile.TemporaryDirectory(dir=where) as scratch:
        with open(os.path.join(scratch, "src"), "wb") as src:
            src.write(os.urandom(size))
        turn = iter(range(REPS))

        def copy() -> None:
            with open(os.path.join(scratch, "src"), "rb") as fin, \
                    open(os.path.join(scratch, f"dst{next(turn)}"), "wb") as fout:
                left = size
                while left > 0:
                    left -= os.copy_file_range(fin.fileno(), fout.fileno(), left)

        return median_seconds(copy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="namespace")
    args = parser.parse_args()
    kwargs: dict[str, Any] = {"branchable": True} if args.backend == "smol" else {}  # the smol marker's keywords
    with Session(backend=args.backend) as session:
        session._run.pool.ahead.pace.free = False  # every guest made when asked (benchmark only)
        made = []

        def fresh() -> None:
            made.append(session.create(**kwargs))

        parent = session.create(**kwargs)
        fresh()  # warm: the first guest starts the helper
        floor = median_seconds(fresh)
        print(f"fresh guest                    {floor * 1000:8.1f} ms   1.00x (floor)")
        for megabytes in (0, 10, 100):
            parent.exec(f"rm -f /w/blob; mkdir -p /w; head -c {megabytes << 20} /dev/urandom > /w/blob", check=True)
            cost = median_seconds(lambda: made.append(parent.branch()))
            raw = raw_copy_seconds(megabytes << 20) if megabytes else 0.0
            against_raw = f"   {cost / (floor + raw):5.2f}x fresh + raw copy ({raw * 1000:.1f} ms)" if megabytes else ""
            print(f"branch, {megabytes:3d} MB in the parent   {cost * 1000:8.1f} ms   {cost / floor:5.2f}x fresh"
                  + against_raw)
            for vm in made:
                session.destroy(vm)
            made.clear()
        parent.exec("rm -f /w/blob; head -c 10485760 /dev/urandom > /w/blob", check=True)
        one_by_one = median_seconds(lambda: made.extend(parent.branch() for _ in range(8)), reps=3)
        for vm in made:
            session.destroy(vm)
        made.clear()
        batch = median_seconds(lambda: made.extend(parent.branch_batch(8)), reps=3)
        for vm in made:
            session.destroy(vm)
        made.clear()
        print(f"8 x branch() (10 MB parent)    {one_by_one * 1000:8.1f} ms   1.00x (floor)")
        print(f"branch_batch(8) (10 MB parent) {batch * 1000:8.1f} ms   {batch / one_by_one:5.2f}x 8 branches")
        run = median_seconds(lambda: parent.exec("true"))
        graded = median_seconds(lambda: parent.reward("true"))
        print(f"exec('true')                   {run * 1000:8.1f} ms   1.00x (floor)")
        print(f"reward('true') (10 MB parent)  {graded * 1000:8.1f} ms   {graded / run:5.2f}x exec")


if __name__ == "__main__":
    main()
