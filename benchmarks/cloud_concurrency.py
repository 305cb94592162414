"""Concurrent async episodes through the loopback smol-cloud server, as ratios measured in one run.

    python benchmarks/cloud_concurrency.py                  # issue 28: 1,000 x 3 s, concurrency 100, -n 2
    python benchmarks/cloud_concurrency.py --episodes 200 --hold 3 --concurrency 50

Starts ``python -m tests.smolcloud`` (its machines are namespace guests on this host), then runs
one suite of ``--episodes`` async episodes, each holding its guest for ``--hold`` seconds of
guest-side ``sleep``, as ``pytest --smol-backend=smol --smol-target=cloud
--smol-concurrency=C -n W``. Prints the wall time against the ideal (episodes x hold / (C x W))
and against the raw floor measured in the same run: the same episodes as plain asyncio tasks,
C x W at once, each in a guest made by the library API (``Session``) against the same server.
Also: peak RSS of all pytest processes (the sum of every process's own peak, VmHWM, sampled),
machines left on the server for the run's token, the API calls the server counted, as the SDK
sent them (creates, branches, branch batches: fewer than episodes when batching works), and
every episode's report (JUnit). Ends with one JSON line. Never part of the test command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import sys
import tempfile
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _rss import PeakRss  # noqa: E402  (benchmarks/ is not a package; a module of its own)
from concurrency import RUN_PLUGINS, floor, timed_pytest  # noqa: E402  (the library-API floor, the same as the namespace benchmark's)

from tests.smolcloud.harness import LoopbackCloud  # noqa: E402

SMOL = ["--smol-backend=smol", "--smol-target=cloud", "--smol-baseline=alpine"]
SUITE = """
import pytest

@pytest.mark.smol_episodes({episodes})
async def test_episode(smol_vm, smol_episode):
    r = await smol_vm.aio.exec("sleep {hold}")
    assert r.exit_code == 0
"""
CREATE_CALLS = ("POST /v1/machines", "POST /v1/machines/{id}/branches", "POST /v1/machines/{id}/fork",
                "POST /v1/machines/{id}/branches/batch", "POST /v1/machines/{id}/fork-batch")


def cpu_seconds(pid: int) -> float:
    """CPU of ``pid`` and its descendants (the server's namespace helper and guests), with what
    each reaped, so far."""
    total, stack = 0, [pid]
    while stack:
        each = stack.pop()
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rpartition(")")[2].split()
            children = Path(f"/proc/{each}/task/{each}/children").read_text().split()
        except OSError:
            continue  # gone meanwhile: its CPU is in its parent's reaped children
        total += sum(int(f) for f in fields[11:15])
        stack.extend(int(c) for c in children)
    return total / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_pytest(directory: Path, env: dict[str, str], *args: str,
               every_plugin: bool = False) -> tuple[float, PeakRss, str]:
    return timed_pytest(directory, env, *SMOL, *args, every_plugin=every_plugin)


def reported(junit: Path) -> dict[str, int]:
    outcomes = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[{"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"] += 1
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--hold", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2, help="-n (0: no xdist)")
    parser.add_argument("--no-floor", action="store_true", help="skip the library-API floor")
    options = parser.parse_args()
    in_flight = options.concurrency * max(options.workers, 1)
    ideal = options.episodes * options.hold / in_flight
    work = Path(tempfile.mkdtemp(prefix="smolvm-cloudconc-"))
    # The stand's machines are namespace guests kept in its state dir: on a tmpfs, where the
    # namespace backend keeps its own guests by default, not on this host's disk. The stand
    # shares the host's cores with pytest here; a real service would not.
    shm = Path("/dev/shm")
    server_dir = Path(tempfile.mkdtemp(prefix="smolvm-cloudconc-server-", dir=shm if shm.is_dir() else None))
    cloud = LoopbackCloud(state_dir=server_dir / "server-state")
    try:
        token = f"bench-{uuid.uuid4().hex[:12]}"
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
        env.update(cloud.env(token), PYTEST_SMOLVM_STATE_DIR=str(work / "state"),
                   PYTEST_DEBUG_TEMPROOT=str(work))  # pytest's own temp dirs: this run's alone
        os.environ.update(env)  # the floor's Session, in this process
        suite = work / "suite"
        suite.mkdir()
        (suite / "test_eps.py").write_text(SUITE.format(episodes=options.episodes, hold=f"{options.hold:g}"))
        run_pytest(suite, env, "-k", "ep0")  # the server's first image lower, outside the timing
        one, _, _ = run_pytest(suite, env, "-k", "ep0")
        one_every_plugin, _, _ = run_pytest(suite, env, "-k", "ep0", every_plugin=True)
        before = cloud.calls(token)
        assert cloud.proc is not None
        server_cpu, pytest_cpu = cpu_seconds(cloud.proc.pid), children_cpu()
        workers = ["-n", str(options.workers)] if options.workers else []
        wall, rss, out = run_pytest(suite, env, f"--smol-concurrency={options.concurrency}", *workers,
                                    f"--junitxml={work / 'junit.xml'}")
        server_cpu, pytest_cpu = cpu_seconds(cloud.proc.pid) - server_cpu, children_cpu() - pytest_cpu
        after = cloud.calls(token)
        calls = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        left = cloud.wait_for_no_machines(token=token, timeout=30)
        outcomes = reported(work / "junit.xml")
        floor_server_cpu = cpu_seconds(cloud.proc.pid)
        cloud_session = {"backend": "smol", "target": "cloud", "baseline": "alpine"}
        floor_wall = None if options.no_floor else asyncio.run(
            floor(options.episodes, options.hold, in_flight, **cloud_session))
        floor_server_cpu = cpu_seconds(cloud.proc.pid) - floor_server_cpu
        creates = sum(calls.get(k, 0) for k in CREATE_CALLS)
        print(f"{options.episodes} episodes x {options.hold:g}s, --smol-concurrency={options.concurrency} "
              f"-n {options.workers}: wall {wall:.2f}s, ideal {ideal:.2f}s, x{wall / ideal:.2f} of the ideal")
        cores = len(os.sched_getaffinity(0))
        print(f"a run of one episode (start-up, the run's source machine, one guest, close): {one:.2f}s; "
              f"{one_every_plugin:.2f}s with every pytest plugin installed here loaded (the runs above load "
              f"only {' '.join(RUN_PLUGINS)})")
        print(f"CPU during the run: pytest processes {pytest_cpu:.1f}s, the server (its machines included) "
              f"{server_cpu:.1f}s, of {wall * cores:.0f}s on {cores} cores")
        if floor_wall is not None:
            print(f"raw floor (library API, {in_flight} asyncio tasks at once): {floor_wall:.2f}s, "
                  f"x{floor_wall / ideal:.2f} of the ideal; pytest is x{wall / floor_wall:.2f} of the floor; "
                  f"server CPU during the floor {floor_server_cpu:.1f}s")
        print(f"peak RSS, all pytest processes together: {rss.total_mb():.0f} MB ({len(rss.peaks)} processes, "
              f"largest {rss.largest_mb():.0f} MB)")
        print(f"machines left on the server: {len(left)}; create calls: {creates} for {options.episodes} "
              f"episodes; reported in JUnit: {outcomes}")
        print("API calls counted by the server: " + ", ".join(f"{k}: {v}" for k, v in sorted(calls.items())))
        print(out.strip().splitlines()[-1])
        print(json.dumps({"episodes": options.episodes, "hold_s": options.hold, "concurrency": options.concurrency,
                          "workers": options.workers, "wall_s": round(wall, 2),
                          "one_episode_run_s": round(one, 2),
                          "one_episode_run_every_plugin_s": round(one_every_plugin, 2), "ideal_s": round(ideal, 2),
                          "wall_over_ideal": round(wall / ideal, 2),
                          "floor_s": None if floor_wall is None else round(floor_wall, 2),
                          "wall_over_floor": None if floor_wall is None else round(wall / floor_wall, 2),
                          "peak_rss_mb_sum": round(rss.total_mb()), "pytest_cpu_s": round(pytest_cpu, 1),
                          "server_cpu_s": round(server_cpu, 1), "machines_left": len(left),
                          "create_calls": creates, "calls": calls, "junit": outcomes}))
    finally:
        status, err = cloud.stop()
        if status != 0:
            print(f"smolcloud exited {status}: {err[-2000:]}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(server_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
