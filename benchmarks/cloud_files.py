"""Files and trees out of a smol machine, against the SDK's own whole-file read, in one run.

    python benchmarks/cloud_files.py            # through the loopback smol-cloud server
    python benchmarks/cloud_files.py --reps 5

The plugin reads a guest's bytes as base64 on an exec stream it can stop at the cap
(``backends/smol/streamed_read.py``). The raw baseline is what the SDK offers for the same job,
with no cap until the end: ``read_file`` of the file; for a tree, the guest's ``tar -cf`` to a
file, ``read_file`` of it, and the host's ``tar -x`` (the integrations' way: harbor's). Both run
against the same machine of ``python -m tests.smolcloud`` (namespace guests on this host).
Prints each median and the ratio. Never part of the test command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.smolcloud.harness import LoopbackCloud  # noqa: E402

SETUP = ("mkdir -p /work/small /work/large && head -c 32m /dev/urandom > /work/file && "
         "for d in $(seq 0 99); do mkdir /work/small/d$d; for f in $(seq 0 99); do "
         "echo 0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890 "
         "> /work/small/d$d/f$f; done; done && "
         "for i in $(seq 0 89); do head -c 1m /dev/urandom > /work/large/f$i; done")


def median_time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="smolvm-cloudfiles-"))
    cloud = LoopbackCloud(state_dir=work / "server-state")
    os.environ.update(cloud.env(f"bench-{uuid.uuid4().hex[:12]}"), PYTEST_SMOLVM_STATE_DIR=str(work / "state"))
    from pytest_smolvm.backends.base import BackendOptions, VMSpec
    from pytest_smolvm.backends.smol.backend import SmolBackend
    from pytest_smolvm.baselines.baseline import Baseline
    from pytest_smolvm.handle.vm import VM

    backend = SmolBackend(BackendOptions(target="cloud"))
    baseline = Baseline("alpine", "registry", None, "alpine")
    try:
        backend.prepare_run(baseline)
        guest = backend.create(VMSpec(name=f"bench-files-{uuid.uuid4().hex[:8]}", baseline=baseline))
        vm, machine = VM(guest), guest._machine
        vm.exec(SETUP, check=True, timeout=600)
        out = work / "out"

        def fresh() -> Path:
            if out.is_dir():
                shutil.rmtree(out)
            out.unlink(missing_ok=True)
            return out

        def sdk_tree(source: str) -> None:
            machine.exec(["tar", "-cf", "/tmp/raw.tar", "-C", source, "."])
            data = machine.read_file("/tmp/raw.tar")
            fresh().mkdir()
            subprocess.run(["tar", "-x", "-C", str(out)], input=data, check=True)

        rows = [
            ("read_file, one 32 MiB file", lambda: vm.read_file("/work/file", max_bytes=64 << 20),
             lambda: machine.read_file("/work/file")),
            ("copy_out, one 32 MiB file", lambda: vm.copy_out("/work/file", fresh()),
             lambda: fresh().write_bytes(machine.read_file("/work/file"))),
            ("copy_out, 10,000 small files", lambda: vm.copy_out("/work/small", fresh()),
             lambda: sdk_tree("/work/small")),
            ("copy_out, 90 x 1 MiB", lambda: vm.copy_out("/work/large", fresh()),
             lambda: sdk_tree("/work/large")),
        ]
        print(f"median of {options.reps} after a warm-up; raw: the SDK's whole-file read_file")
        for label, plugin, raw in rows:
            raw_s = median_time(raw, options.reps)
            plugin_s = median_time(plugin, options.reps)
            print(f"{label:32s} plugin {plugin_s:7.3f}s   raw {raw_s:7.3f}s   x{plugin_s / raw_s:.2f}")
        guest.destroy()
    finally:
        backend.close()
        status, err = cloud.stop()
        shutil.rmtree(work, ignore_errors=True)
        if status != 0:
            print(f"smolcloud exited {status}: {err}", file=sys.stderr)


if __name__ == "__main__":
    main()
