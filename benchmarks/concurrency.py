"""Concurrent async episodes on the namespace backend, as ratios measured in one run.

    python benchmarks/concurrency.py                       # 40 episodes x 1 s; curve 1,5,10,20,40
    python benchmarks/concurrency.py --episodes 400 --hold 2 --curve 1,10,50,100,200

Each episode holds its guest for ``--hold`` seconds of guest-side ``sleep``. Prints, for each
concurrency of the curve, the wall time of ``pytest --smol-concurrency=C`` against the ideal
(episodes x hold / C), the floor (the same episodes as plain asyncio tasks, each in a guest made
by the library API, at the same concurrency) and ``-n 2`` without concurrency; then one JSON line.
Peak RSS is the sum of every pytest process's own peak (benchmarks/_rss.py), per run. ``--no-serial``
skips the ``-n 2`` row (episodes x hold / 2 seconds). Never part of the test command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rss import PeakRss

SUITE = """
import pytest

@pytest.mark.smol_episodes({episodes})
async def test_episode(smol_vm, smol_episode):
    r = await smol_vm.aio.exec("sleep {hold}")
    assert r.exit_code == 0
"""


PEAKS: list[float] = []  # summed peak RSS of each pytest run, MB


# The plugins these suites need. Whatever else this host has installed (hypothesis, allure, ...)
# would add its own start-up to every run: ~2 s a run here, none of it this project's.
RUN_PLUGINS = ("-p", "smolvm", "-p", "xdist")


def timed_pytest(directory: Path, env: dict[str, str], *args: str,
                 every_plugin: bool = False) -> tuple[float, PeakRss, str]:
    """A pytest run in ``directory``: its wall time, the peak RSS of its processes, its output.
    With ``every_plugin``, every plugin installed here loads, as in a plain ``pytest``."""
    started = time.perf_counter()
    plugins = ("-p", "no:anyio") if every_plugin else RUN_PLUGINS
    env = env if every_plugin else {**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, *args],
                            cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    with PeakRss(proc.pid) as rss:
        out, _ = proc.communicate()
        rss.sample()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"pytest {' '.join(args)} failed ({proc.returncode}):\n{out[-4000:]}")
    return wall, rss, out


def pytest_wall(directory: Path, *args: str) -> float:
    env = dict(os.environ, PYTEST_DEBUG_TEMPROOT=str(directory))  # pytest's own temp dirs: this run's alone
    wall, rss, _out = timed_pytest(directory, env, *args)
    PEAKS.append(rss.total_mb())
    return wall


async def floor(episodes: int, hold: float, concurrency: int, **session_keywords: Any) -> float:
    """The same episodes as plain asyncio tasks, each in a guest the library API makes (a
    namespace guest unless ``session_keywords`` say otherwise): the floor pytest is held to."""
    from pytest_smolvm import Session

    limit = asyncio.Semaphore(concurrency)
    async with Session(**(session_keywords or {"backend": "namespace"})) as session:
        await session.adestroy(await session.acreate())  # the run's one decision, outside the timing

        async def one() -> None:
            async with limit:
                vm = await session.acreate()
                try:
                    await vm.aio.exec(f"sleep {hold:g}")
                finally:
                    await session.adestroy(vm)

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(episodes)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--curve", default="1,5,10,20,40")
    parser.add_argument("--no-serial", action="store_true", help="skip the -n 2 row without concurrency")
    parser.add_argument("--no-floor", action="store_true", help="skip the library-API floor of each point")
    options = parser.parse_args()
    curve = [int(c) for c in options.curve.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="smolvm-conc-") as tmp:
        directory = Path(tmp)
        (directory / "test_eps.py").write_text(SUITE.format(episodes=options.episodes, hold=f"{options.hold:g}"))
        pytest_wall(directory, "-k", "ep0")  # unpack the baseline once, outside the timing
        serial_n2 = None if options.no_serial else pytest_wall(directory, "-n", "2")
        if serial_n2 is not None:
            print(f"-n 2 without concurrency: {serial_n2:.2f}s", flush=True)
        for concurrency in curve:
            wall = pytest_wall(directory, f"--smol-concurrency={concurrency}")
            rss_mb = PEAKS[-1]
            floor_wall = None if options.no_floor else asyncio.run(floor(options.episodes, options.hold, concurrency))
            ideal = options.episodes * options.hold / concurrency
            rows.append({"concurrency": concurrency, "wall_s": round(wall, 2), "ideal_s": round(ideal, 2),
                         "floor_s": None if floor_wall is None else round(floor_wall, 2),
                         "wall_over_ideal": round(wall / ideal, 2),
                         "wall_over_floor": None if floor_wall is None else round(wall / floor_wall, 2),
                         "peak_rss_mb": round(rss_mb)})
            against = "" if floor_wall is None else \
                f"floor {floor_wall:7.2f}s  x{wall / floor_wall:5.2f} of the floor  "
            print(f"concurrency {concurrency:4d}: wall {wall:7.2f}s  ideal {ideal:7.2f}s  x{wall / ideal:5.2f}  "
                  f"{against}peak RSS {rss_mb:.0f} MB", flush=True)
    print(f"cores: {len(os.sched_getaffinity(0))}")
    print(json.dumps({"episodes": options.episodes, "hold_s": options.hold,
                      "n2_serial_s": None if serial_n2 is None else round(serial_n2, 2), "curve": rows}))


if __name__ == "__main__":
    main()
