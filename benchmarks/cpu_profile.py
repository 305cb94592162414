"""Where each test's CPU goes, by process role: the scaling suite in guests next to the same work unisolated.

    python benchmarks/cpu_profile.py              # 300 tests per suite, about a minute
    python benchmarks/cpu_profile.py --tests 150

Runs the scaling benchmark's two suites (benchmarks/run.py: a ~30 ms busybox loop per test, in a
fresh guest or by subprocess on the host) once each at ``-n 2`` under ``perf record -a -g``, then
gives every sample taken while tests ran to the role of the process it hit:

    pytest controller / worker main thread / worker's other threads (made ahead, teardown)
    smolvm helper (the zygote) / guest setup, init and request children / the test's work
    kernel threads (cgroup and network-namespace teardown) / the rest of the host / idle

and prints CPU milliseconds per test for each, and for the guest side the kernel work it spent
them in. Needs perf(1) and system-wide sampling (root, or kernel.perf_event_paranoid <= -1).
Sampling with call graphs costs CPU of its own (~10-15% here): compare rows within one run,
not with benchmarks/run.py's times.

First, without perf: the CPU of one guest on all its processes (getrusage of the processes and
everything they reaped) for the issue's kernel floor, the floor with the guest's mounts, and the
backend's bare loop (create, exec "true", destroy; no pytest, no records), each as the
difference between a run of 250 and one of 50, so start-up cancels out. Kernel threads
(network-namespace teardown) are in none of these. Never part of the test command.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench  # noqa: E402  (benchmarks/ is not a package)

SAMPLE_HZ = 999
TASK_EVENT = re.compile(r"PERF_RECORD_FORK\((\d+):(\d+)\):\((\d+):(\d+)\)")
SAMPLE_HEAD = re.compile(r"^(\S.*?)\s+(\d+)/(\d+)\s+([\d.]+):\s*$")
KERNEL_THREADS = ("kworker", "ksoftirqd", "rcu", "migration", "kcompactd", "kswapd", "khugepaged")
GUEST_SIDE = "guest setup, init and request children"
ROLES = ("the test's work (busybox sh)", "pytest worker, main thread", "pytest worker, other threads",
         "pytest controller", "smolvm helper (zygote)", GUEST_SIDE, "kernel threads", "rest of the host", "idle")


@dataclass
class Sample:
    comm: str
    pid: int
    tid: int
    time: float
    frames: list[str] = field(default_factory=list)  # leaf first


@dataclass
class Profile:
    tests: int
    ms_per_test: dict[str, float]
    guest_side_kernel: list[tuple[str, float]]


def record(cfg: bench.Config, suite: Path, tests: int, data: Path) -> int:
    """Run ``suite`` at -n 2 under perf; returns perf's own pid (the suite's pytest is its child)."""
    env = {**cfg.env, "SMOLVM_BENCH_N": str(tests), "PYTHONDONTWRITEBYTECODE": "1",
           "SMOLVM_BENCH_OUT": str(suite.parent / "steady.json"),
           "SMOLVM_BENCH_SH": json.dumps(bench.baseline_shell())}
    argv = ["perf", "record", "-a", "-g", "-F", str(SAMPLE_HZ), "-o", str(data), "--",
            sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
            "-o", "addopts=", "--rootdir", str(suite.parent), "-n", "2"]
    proc = subprocess.Popen(argv, env=env, cwd=suite.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"perf record of {suite.name} failed:\n{out[-2000:]}\n{err[-2000:]}")
    return proc.pid


def read_samples(data: Path) -> tuple[list[Sample], dict[int, int]]:
    """The samples (with call chains) and each process's parent, from perf's task events."""
    text = subprocess.run(["perf", "script", "-i", str(data), "--show-task-events", "-F", "comm,pid,tid,time,ip,sym"],
                          capture_output=True, text=True, check=True).stdout
    parent: dict[int, int] = {}
    samples: list[Sample] = []
    current: Sample | None = None
    for line in text.splitlines():
        fork = TASK_EVENT.search(line)
        if fork:
            pid, tid, ppid = int(fork.group(1)), int(fork.group(2)), int(fork.group(3))
            if pid == tid:  # a new process, not a new thread
                parent[pid] = ppid
            continue
        if not line.strip():
            if current:
                samples.append(current)
            current = None
            continue
        head = SAMPLE_HEAD.match(line)
        if head and not line[0].isspace():
            current = Sample(head.group(1).strip(), int(head.group(2)), int(head.group(3)), float(head.group(4)))
        elif current is not None:
            parts = line.split(None, 1)
            current.frames.append((parts[1] if len(parts) > 1 else "?").split("+0x")[0].split(" (")[0])
    if current:
        samples.append(current)
    return samples, parent


def attribute(samples: list[Sample], parent: dict[int, int], perf_pid: int) -> Profile:
    controller = next(pid for pid, ppid in parent.items() if ppid == perf_pid)
    workers = {pid for pid, ppid in parent.items() if ppid == controller}
    forkers = set(parent.values())
    # The zygote: the worker's child that forks (the unisolated suite's children only exec).
    helpers = {pid for pid, ppid in parent.items() if ppid in workers and pid in forkers}

    def under(pid: int, ancestors: set[int]) -> bool:
        for _ in range(64):
            if pid not in parent:
                return False
            pid = parent[pid]
            if pid in ancestors:
                return True
        return False

    python = next(s.comm for s in samples if s.pid == controller)  # "python3", or however the binary is named

    def role(s: Sample) -> str:
        if s.pid == 0:
            return "idle"
        if s.pid == controller:
            return "pytest controller"
        if s.pid in workers:
            return "pytest worker, main thread" if s.tid == s.pid else "pytest worker, other threads"
        if s.pid in helpers:
            return "smolvm helper (zygote)"
        if under(s.pid, helpers) and s.comm == python:
            return GUEST_SIDE
        if under(s.pid, workers):
            return ROLES[0]  # a guest's shell, or the unisolated suite's (a spawn before its exec too)
        return "kernel threads" if s.comm.startswith(KERNEL_THREADS) else "rest of the host"

    roles = [(s, role(s)) for s in samples]
    work = [s for s, r in roles if r == ROLES[0] and s.comm != python]
    if not work:
        raise SystemExit("no sample of the tests' work: did the suite run?")
    # While tests ran, a second in from each end: not pytest's start-up or its summary.
    lo, hi = min(s.time for s in work) + 1, max(s.time for s in work) - 1
    inside = [(s, r) for s, r in roles if lo <= s.time <= hi]
    tests = len({s.pid for s, r in inside if r == ROLES[0] and s.comm != python})  # one shell per test
    per_test = 1e3 / SAMPLE_HZ / max(tests, 1)
    counts = collections.Counter(r for _, r in inside)
    kernel: collections.Counter[str] = collections.Counter()
    for s, r in inside:
        if r == GUEST_SIDE:
            chain = s.frames[::-1]
            entry = next((f for f in chain if f.startswith(("__x64_sys_", "__do_sys_"))), None)
            fault = any("exc_page_fault" in f for f in chain)
            kernel[entry.replace("__x64_sys_", "").replace("__do_sys_", "") if entry
                   else "page faults (copy-on-write of the helper)" if fault else "user space and the rest"] += 1
    return Profile(tests, {r: counts[r] * per_test for r in ROLES},
                   [(k, n * per_test) for k, n in kernel.most_common(8)])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_per_guest(cfg: bench.Config, rounds: int = 3) -> dict[str, list[float]]:
    """ms of CPU per guest on all its processes, per interleaved round (see the module's docstring)."""
    few, many = 50, 250
    out = cfg.root / "bare.json"
    commands: dict[str, Callable[[int], list[str]]] = {
        "issue's kernel floor": lambda n: bench.floor_command(cfg, n),
        "floor with the guest's mounts": lambda n: bench.floor_command(cfg, n, guest_mounts=True),
        "backend's bare loop (+ exec of sh)": lambda n: [sys.executable, str(HERE / "_bare.py"), str(n), str(out)],
    }
    found: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            spent = []
            for n in (few, many):
                before = _children_cpu()
                bench.run_checked(command(n), cfg.env, bench.REPO)
                spent.append(_children_cpu() - before)
            found[name].append((spent[1] - spent[0]) / (many - few) * 1e3)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=300, help="tests per suite (default 300)")
    args = parser.parse_args()
    if args.tests < 60:
        parser.error("--tests: at least 60, so that a few seconds of tests run between start-up and the summary")
    with bench.bench_dirs(quick=False) as cfg:
        print(f"{'CPU ms per guest, all its processes':40s} {'median':>8s}  rounds")
        for name, per_round in cpu_per_guest(cfg).items():
            print(f"{name:40s} {bench.median(per_round):8.2f}  {', '.join(f'{v:.2f}' for v in per_round)}")
        print(flush=True)
    if shutil.which("perf") is None:
        raise SystemExit("cpu_profile: the rest needs perf(1) (linux-perf / linux-tools) on PATH")
    profiles: dict[str, Profile] = {}
    with bench.bench_dirs(quick=False) as cfg:
        suite_dir = cfg.root / "profile"
        suite_dir.mkdir()
        (suite_dir / "conftest.py").write_text(bench.STEADY_CONFTEST)
        for name, source in (("guests", bench.SCALING_SUITE), ("unisolated", bench.SCALING_RAW_SUITE)):
            suite = suite_dir / f"test_{name}.py"
            suite.write_text(source)
            data = cfg.root / f"{name}.perf"
            perf_pid = record(cfg, suite, args.tests, data)
            profiles[name] = attribute(*read_samples(data), perf_pid)
            print(f"[{name}: {profiles[name].tests} tests sampled]", file=sys.stderr, flush=True)
    guests, raw = profiles["guests"], profiles["unisolated"]
    print(f"{'CPU ms per test, -n 2, perf -g':40s} {'guests':>8s} {'unisolated':>11s} {'difference':>11s}")
    for r in ROLES:
        print(f"{r:40s} {guests.ms_per_test[r]:8.2f} {raw.ms_per_test[r]:11.2f} "
              f"{guests.ms_per_test[r] - raw.ms_per_test[r]:+11.2f}")
    # The work's own samples swing by a few ms between the two runs (same binary, same loop):
    # the overhead to compare is everything else.
    for label, leave_out in (("busy, all roles", {"idle"}), ("busy, all but the work", {"idle", ROLES[0]})):
        busy = {name: sum(v for r, v in p.ms_per_test.items() if r not in leave_out) for name, p in profiles.items()}
        print(f"{label:40s} {busy['guests']:8.2f} {busy['unisolated']:11.2f} "
              f"{busy['guests'] - busy['unisolated']:+11.2f}")
    print(f"\n{GUEST_SIDE}, by where it ran:")
    for what, ms in guests.guest_side_kernel:
        print(f"  {what:42s} {ms:8.2f}")


if __name__ == "__main__":
    main()
