"""The scaling suite three ways: in guests, in the kernel floor's hardened namespaces, unisolated.

    python benchmarks/scaling_floor.py              # 3 interleaved rounds, about 3 minutes
    python benchmarks/scaling_floor.py --rounds 1

benchmarks/run.py's scaling row compares guests with the same work unisolated. This adds what a
hardened namespace per test costs with no plugin and no guest helper: each test asks a small
server (``_floor.py serve``, one per xdist worker) for one floor iteration with the guest's
mounts (cgroups with limits, fresh namespaces, the overlay, /dev, masked /proc, pivot_root,
seccomp), whose pid 1 runs the test's loop with the guest's own busybox. The server does each
test's namespace from start to teardown while the test waits: no guest is made ahead and no
teardown is handed off, as the kernel's minimum would have it.

Prints tests per second at -n 1 and -n 2 for each suite, the ratios, and one JSON line. Never part
of the test command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench  # noqa: E402  (benchmarks/ is not a package)

FLOOR_SUITE = bench.SCALING_WORK + """
import atexit
import json
import subprocess
import sys

_server = []


def floor_server():
    if not _server:  # one per worker, started at its first test
        argv = [sys.executable, "-I", "-S", os.environ["SMOLVM_FLOOR_SCRIPT"], "serve",
                *json.loads(os.environ["SMOLVM_FLOOR_ARGS"]), "/bin/sh", "-c", WORK]
        _server.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        atexit.register(lambda: (_server[0].stdin.close(), _server[0].wait()))
    return _server[0]


@pytest.mark.parametrize("i", range(N))
def test_floor(i):
    server = floor_server()
    server.stdin.write("next\\n")
    server.stdin.flush()
    assert json.loads(server.stdout.readline()) == "12000\\n"
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    from pytest_smolvm.backends.namespace import seccomp
    from pytest_smolvm.baselines.baseline import resolve
    from pytest_smolvm.baselines.cache import unpack

    with bench.bench_dirs(quick=False) as cfg:
        suite_dir = cfg.root / "scaling-floor"
        suite_dir.mkdir()
        floor_dir = Path(cfg.env["XDG_RUNTIME_DIR"]) / "floor"  # on the tmpfs, as guests' scratch dirs are
        floor_dir.mkdir()
        bpf = cfg.root / "guest-filter.bpf"
        bpf.write_bytes(seccomp.guest_filter())
        (suite_dir / "conftest.py").write_text(bench.STEADY_CONFTEST)
        suites = {"guests": (suite_dir / "test_guests.py", bench.SCALING_SUITE, 200),
                  "kernel floor, no plugin": (suite_dir / "test_floor.py", FLOOR_SUITE, 200),
                  "unisolated": (suite_dir / "test_raw.py", bench.SCALING_RAW_SUITE, 100)}
        for path, source, _ in suites.values():
            path.write_text(source)
        out = suite_dir / "steady.json"
        env = {"SMOLVM_BENCH_OUT": str(out), "SMOLVM_BENCH_SH": json.dumps(bench.baseline_shell()),
               "SMOLVM_FLOOR_SCRIPT": str(HERE / "_floor.py"),
               "SMOLVM_FLOOR_ARGS": json.dumps([str(unpack(resolve(None, bench.REPO)).path), str(floor_dir), str(bpf)])}
        for path, _, n in suites.values():  # warm-up, and a check that each suite passes
            bench._pytest_wall(cfg, path, n // 5, ["-n", "2"], **env)
        rates: dict[tuple[str, str], list[float]] = {(name, w): [] for name in suites for w in ("1", "2")}
        for _ in range(args.rounds):
            for (name, workers), sink in rates.items():
                path, _, n = suites[name]
                bench._pytest_wall(cfg, path, n, ["-n", workers], **env)
                sink.append(1 / json.loads(out.read_text()))
    report = {}
    print(f"{'suite':26s} {'-n 1 tests/s':>13s} {'-n 2 tests/s':>13s} {'-n 2 / -n 1':>12s}  per round")
    for name in suites:
        one, two = rates[(name, "1")], rates[(name, "2")]
        ratio = bench.median(two) / bench.median(one)
        rounds = ", ".join(f"{b / a:.2f}" for a, b in zip(one, two, strict=True))
        print(f"{name:26s} {bench.median(one):13.1f} {bench.median(two):13.1f} {ratio:11.2f}x  {rounds}")
        report[name] = {"n1": one, "n2": two}
    print("SCALING-FLOOR-JSON " + json.dumps(report))


if __name__ == "__main__":
    main()
