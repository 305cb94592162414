"""pytest-smolvm benchmarks (namespace backend): each figure next to its raw floor, measured in the same run.

    python benchmarks/run.py            # the full set, a few minutes
    python benchmarks/run.py --quick    # fewer repetitions, smaller suites (about a minute)
    python benchmarks/run.py --only exec,copy

Prints a table, then one JSON line (``BENCH-JSON {...}``). Every figure is a median over repeated
runs after a warm-up. Everything happens under fresh temp dirs (XDG_STATE_HOME, XDG_RUNTIME_DIR
on /dev/shm, PYTEST_SMOLVM_CACHE_DIR), which are removed at the end; the plugin is byte-compiled
first, as pip installs it. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pytest_smolvm.baselines.cache import force_rmtree

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SH_TRUE = ["/bin/sh", "-c", "true"]
FLOOR = "kernel floor (cgroups+fork+unshare+overlay+seccomp+spawn)"
FLOOR_WITH_GUEST_MOUNTS = "kernel floor + the guest's /dev, /proc masks, pivot_root"


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    floor_name: str = ""
    floor: float | None = None
    target: str = ""
    ok: bool | None = None
    method: str = ""

    @property
    def ratio(self) -> float | None:
        return self.value / self.floor if self.floor else None


@dataclass
class Config:
    quick: bool
    root: Path
    env: dict[str, str]

    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full


def median(values: list[float]) -> float:
    return statistics.median(values)


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run_checked(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"benchmark step failed: {' '.join(argv)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def wall(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> float:
    started = time.perf_counter()
    run_checked(argv, env, cwd)
    return time.perf_counter() - started


# ------------------------------------------------------------------------------ in-process helpers


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def bench_dirs(quick: bool) -> Iterator[Config]:
    """Fresh state, runtime and cache dirs for one benchmark session, removed at its end.

    The default layout, in dirs of its own: the state dir on the host's disk and the runtime
    dir on a tmpfs, as a user's XDG runtime dir or /run is (not one PYTEST_SMOLVM_STATE_DIR).
    """
    # As pip leaves an installed package: byte-compiled. Without this, a tree whose edits (or a
    # PYTHONDONTWRITEBYTECODE host) left stale caches compiles the plugin in every process of
    # every run, and the figures drift with the state of the tree (~20-40 ms per process here).
    import pytest_smolvm

    compileall.compile_dir(Path(pytest_smolvm.__file__).parent, quiet=1)
    root = Path(tempfile.mkdtemp(prefix="smolvm-bench-"))
    shm = Path("/dev/shm")
    runtime = Path(tempfile.mkdtemp(prefix="smolvm-bench-run-", dir=shm if shm.is_dir() else root))
    isolated = {"XDG_STATE_HOME": str(root / "state"), "XDG_RUNTIME_DIR": str(runtime),
                "PYTEST_SMOLVM_CACHE_DIR": str(root / "cache")}
    env = {**os.environ, **isolated}
    for variable in ("PYTEST_XDIST_WORKER", "PYTEST_SMOLVM_STATE_DIR"):
        env.pop(variable, None)
        os.environ.pop(variable, None)
    os.environ.update(isolated)
    # Stopped by `timeout` or a job control SIGTERM, the dirs go too (by default it kills at once).
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield Config(quick, root, env)
    finally:
        signal.signal(signal.SIGTERM, previous)
        leftovers = [path for base in (root / "state" / "pytest-smolvm", runtime / "pytest-smolvm")
                     for path in (base / "scratch").glob("*")]
        force_rmtree(root)
        force_rmtree(runtime)
        if leftovers:
            print(f"WARNING: {len(leftovers)} scratch dirs were left behind", file=sys.stderr)


@contextmanager
def backend_session() -> Iterator[tuple[Any, Any]]:
    from pytest_smolvm.backends.namespace.backend import NamespaceBackend
    from pytest_smolvm.baselines.baseline import resolve

    backend = NamespaceBackend()
    baseline = resolve(None, REPO)
    backend.prepare_run(baseline)
    try:
        yield backend, baseline
    finally:
        # A benchmark that fails between a create and its destroy must not leave the guest's
        # cgroups behind: these guests have no registry record for the reaper to find.
        while _made:
            with suppress(Exception):
                _made.pop().destroy()  # a no-op for one destroyed already
        backend.close()


_names = iter(range(1, 1 << 30))
_made: list[Any] = []  # every guest new_guest made in this process


def new_guest(backend: Any, baseline: Any) -> Any:
    from pytest_smolvm.backends.base import VMSpec

    guest = backend.create(VMSpec(name=f"bench-{os.getpid()}-{next(_names)}", baseline=baseline))
    _made.append(guest)
    return guest


def helper_quiet(backend: Any) -> None:
    """Return once the namespace helper has no work left from the guests before: what it does
    between guests (a disk cleaned, dropped, made ahead) must not land in a raw floor measured
    next. Its ping answers once the pool's work is done; a dropped disk's last close is a child
    of its own, which frees the disk as it exits (a zombie then, until the helper's next round;
    bounded: 10 s)."""
    helper = backend._helper()
    helper.request({"op": "ping"})
    children = Path(f"/proc/{helper._proc.pid}/task/{helper._proc.pid}/children")

    def exiting(pid: str) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False  # reaped meanwhile

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with suppress(OSError):
            if not any(exiting(pid) for pid in children.read_text().split()):
                return
        time.sleep(0.005)


def guest_exec(guest: Any, argv: list[str]) -> None:
    result = guest.exec(argv, env={}, workdir=None, stdin=None, timeout=None, output_limit=1 << 20)
    assert result.exit_code == 0, result


# ------------------------------------------------------------------------------ figures


def bench_baseline(cfg: Config) -> list[Figure]:
    """First use: unpack the bundled rootfs into an empty cache; then the cache-hit cost."""
    from pytest_smolvm.baselines.baseline import bundled_rootfs_tarball

    probe = textwrap.dedent("""
        import time
        from pathlib import Path
        started = time.perf_counter()
        from pytest_smolvm.baselines.baseline import resolve
        from pytest_smolvm.baselines.cache import unpack
        rootfs = unpack(resolve(None, Path.cwd()))
        print(time.perf_counter() - started)
    """)
    tarball = bundled_rootfs_tarball()
    first, hit, floor = [], [], []
    for i in range(cfg.n(3, 1) + 1):  # the first round warms the page cache and is dropped
        cache = cfg.root / f"cache-first-{i}"
        env = {**cfg.env, "PYTEST_SMOLVM_CACHE_DIR": str(cache)}
        first_s = float(run_checked([sys.executable, "-c", probe], env, REPO).stdout)
        hit_s = float(run_checked([sys.executable, "-c", probe], env, REPO).stdout)
        force_rmtree(cache)
        dest = cfg.root / f"tar-floor-{i}"
        dest.mkdir()
        floor_s = wall(["tar", "--zstd", "-xf", str(tarball), "-C", str(dest)], cfg.env)
        force_rmtree(dest)
        if i:
            first.append(first_s)
            hit.append(hit_s)
            floor.append(floor_s)
    return [
        Figure("baseline first use (unpack bundled rootfs)", median(first), "s", "tar --zstd -xf", median(floor),
               "(none)", None, "import + resolve + unpack into an empty cache, in a fresh interpreter"),
        Figure("baseline cache hit", median(hit), "s", "", None, "(none)", None,
               "import + resolve + unpack with the cache populated"),
    ]


def floor_command(cfg: Config, iterations: int, guest_mounts: bool = False) -> list[str]:
    """argv of benchmarks/_floor.py for ``iterations`` (plus 5 of warm-up), on the guests' tmpfs."""
    from pytest_smolvm.backends.namespace import seccomp
    from pytest_smolvm.baselines.baseline import resolve
    from pytest_smolvm.baselines.cache import unpack

    lower = str(unpack(resolve(None, REPO)).path)
    floor_dir = Path(os.environ.get("XDG_RUNTIME_DIR") or cfg.root) / "floor"  # where guests' scratch dirs are
    floor_dir.mkdir(exist_ok=True)
    bpf = cfg.root / "guest-filter.bpf"
    if not bpf.exists():
        bpf.write_bytes(seccomp.guest_filter())
    return [sys.executable, "-I", "-S", str(HERE / "_floor.py"), lower, str(floor_dir), str(iterations + 5), str(bpf),
            *(["guest-mounts"] if guest_mounts else [])]


def floor_times(cfg: Config, iterations: int, guest_mounts: bool = False) -> list[float]:
    """Seconds per iteration of the kernel floor (benchmarks/_floor.py), the first 5 dropped as warm-up.

    The floor confines as a guest is confined by default: its cgroups with their limits and the
    same seccomp filter, so the ratio against it is what the plugin adds, not what hardening costs.
    """
    out = run_checked(floor_command(cfg, iterations, guest_mounts), cfg.env).stdout
    return [float(t) for t in json.loads(out)[5:]]


def bench_floor_vs_bare(cfg: Config) -> list[Figure]:
    """Per guest: bare create + exec + destroy vs the kernel floor, interleaved in rounds."""
    rounds, per_round = cfg.n(5, 3), cfg.n(40, 20)
    floor: list[float] = []
    bare: list[float] = []
    with backend_session() as (backend, baseline):
        for _ in range(10):  # warm-up: the zygote, the page cache, the allocator
            guest = new_guest(backend, baseline)
            guest_exec(guest, SH_TRUE)
            guest.destroy()

        def one() -> None:
            guest = new_guest(backend, baseline)
            guest_exec(guest, SH_TRUE)
            guest.destroy()

        for _ in range(rounds):
            floor += floor_times(cfg, per_round)
            bare += [timed(one) for _ in range(per_round)]
    return [Figure("bare backend loop (create+exec+destroy)", median(bare) * 1e3, "ms",
                   FLOOR, median(floor) * 1e3, "<= 3x", None,
                   f"per-iteration medians, {len(bare)} each, interleaved in {rounds} rounds")]


def bench_exec(cfg: Config) -> list[Figure]:
    rounds, per_round = cfg.n(5, 3), cfg.n(100, 40)
    ours: list[float] = []
    floor: list[float] = []
    with backend_session() as (backend, baseline):
        guest = new_guest(backend, baseline)
        try:
            for _ in range(20):
                guest_exec(guest, ["true"])
                subprocess.run(["true"])
            for _ in range(rounds):
                ours += [timed(lambda: guest_exec(guest, ["true"])) for _ in range(per_round)]
                floor += [timed(lambda: subprocess.run(["true"])) for _ in range(per_round)]
        finally:
            guest.destroy()
    return [Figure('exec(["true"]) round trip', median(ours) * 1e3, "ms", 'subprocess.run(["true"])',
                   median(floor) * 1e3, "<= 2x", None, f"per-call medians, {len(ours)} each, interleaved")]


def _make_tree(root: Path, files: int, size: int, per_dir: int) -> None:
    if per_dir == 0:  # a chain: ``files`` directories, each inside the last, one file at the bottom
        bottom = root / "/".join(["d"] * files)
        subprocess.run(["mkdir", "-p", str(bottom)], check=True)  # os.makedirs recurses per level
        (bottom / "f").write_bytes(os.urandom(size))
        return
    for i in range(files):
        d = root / f"d{i // per_dir:03d}"
        if i % per_dir == 0:
            d.mkdir(parents=True)
        (d / f"f{i:05d}").write_bytes(os.urandom(size))


def _tar_into_overlay(source: Path, scratch: Path, env: dict[str, str]) -> float:
    """``tar c | tar x`` into an overlay mount made as a guest's root is (an empty lower layer,
    upper and work on the same tmpfs as ``scratch``); root only."""
    lower, upper, work, merged = (scratch / d for d in ("lower", "upper", "work", "merged"))
    for d in (lower, upper, work, merged):
        d.mkdir(parents=True)
    subprocess.run(["mount", "-t", "overlay", "bench-overlay", "-o",
                    f"lowerdir={lower},upperdir={upper},workdir={work}", str(merged)], check=True)
    try:
        (merged / "tree").mkdir()
        return wall(["sh", "-c", f"tar -C '{source}' -cf - . | tar -C '{merged}/tree' -xf -"], env)
    finally:
        subprocess.run(["umount", str(merged)], check=True)
        force_rmtree(scratch)


def bench_copy(cfg: Config) -> list[Figure]:
    from pytest_smolvm.handle.vm import VM

    # The guest's files live in tmpfs; the host side of every copy (source, floor and copy_out
    # destinations) does too where /dev/shm allows, so that the disk (slow and noisy for 10,000
    # small files on this host's ext4) measures neither side.
    shm = Path("/dev/shm")
    fast_dir = Path(tempfile.mkdtemp(prefix="smolvm-bench-", dir=shm)) if shm.is_dir() and os.access(
        shm, os.W_OK) else cfg.root / "fast"
    fast_dir.mkdir(exist_ok=True)
    trees = {"100 MB tree (100 x 1 MB)": (100, 1 << 20, 10), "10,000 small files (100 B)": (10_000, 100, 100),
             # a guest's deep tree: each directory must be reached from its parent, not the root
             "a chain of 1,200 nested directories": (1_200, 100, 0)}
    reps = cfg.n(3, 1)
    figures = []
    try:
        with backend_session() as (backend, baseline):
            for label, (files, size, per_dir) in trees.items():
                src = fast_dir / "copy-src"
                _make_tree(src, files, size, per_dir)
                t_in: list[float] = []
                t_out: list[float] = []
                f_in: list[float] = []
                f_out: list[float] = []
                f_overlay: list[float] = []
                for rep in range(reps + 1):  # rep 0 is the warm-up
                    vm = VM(new_guest(backend, baseline))
                    try:
                        started = time.perf_counter()
                        vm.copy_in(src, "/work/tree")
                        t_in.append(time.perf_counter() - started)
                        dest = fast_dir / f"copy-out-{rep}"
                        started = time.perf_counter()
                        vm.copy_out("/work/tree", dest)
                        t_out.append(time.perf_counter() - started)
                        force_rmtree(dest)
                    finally:
                        vm._guest.destroy()
                    helper_quiet(backend)
                    floor_in = fast_dir / f"in-{rep}"
                    floor_out = fast_dir / f"floor-out-{rep}"
                    for dest, source in ((floor_in, src), (floor_out, floor_in)):
                        dest.mkdir()
                        (f_in if dest is floor_in else f_out).append(wall(
                            ["sh", "-c", f"tar -C '{source}' -cf - . | tar -C '{dest}' -xf -"], cfg.env))
                    force_rmtree(floor_in)
                    force_rmtree(floor_out)
                    if os.geteuid() == 0:
                        f_overlay.append(_tar_into_overlay(src, fast_dir / f"overlay-{rep}", cfg.env))
                force_rmtree(src)
                figures.append(Figure(f"copy_in {label}", median(t_in[1:]), "s", "tar c | tar x (host)",
                                      median(f_in[1:]), "<= 1.5x", None, f"median of {reps} after a warm-up"))
                if f_overlay:
                    # A guest's root is an overlay on the baseline (its copy-on-write fork), so
                    # every file copied in is made in an overlay: the kernel's share, apart.
                    figures.append(Figure(f"copy_in {label}, against the same tar into an overlay", median(t_in[1:]),
                                          "s", "tar c | tar x into an overlay on tmpfs (host)",
                                          median(f_overlay[1:]), "<= 1.5x", None,
                                          f"median of {reps} after a warm-up; the guest root's layering"))
                figures.append(Figure(f"copy_out {label}", median(t_out[1:]), "s", "tar c | tar x (host)",
                                      median(f_out[1:]), "<= 1.5x", None, f"median of {reps} after a warm-up"))
    finally:
        force_rmtree(fast_dir)
    return figures


SUITE = """
import os
import pytest

N = int(os.environ["SMOLVM_BENCH_N"])


@pytest.mark.parametrize("i", range(N))
def test_vm(smol_vm, i):
    smol_vm.exec("true")
"""

# A little CPU work in the guest per test: ~30 ms of the baseline's busybox shell arithmetic on
# these hosts (the host's dash does the same loop in ~18 ms, so the raw suite runs busybox too).
SCALING_WORK = """
import os
import pytest

N = int(os.environ["SMOLVM_BENCH_N"])
WORK = "i=0; while [ $i -lt 12000 ]; do i=$((i+1)); done; echo $i"
"""

SCALING_SUITE = SCALING_WORK + """

@pytest.mark.parametrize("i", range(N))
def test_vm(smol_vm, i):
    assert smol_vm.exec(WORK).stdout == "12000\\n"
"""

# The same work with no isolation at all: the baseline's own shell, run by subprocess on the host
# through the baseline's musl loader (SMOLVM_BENCH_SH, a JSON argv prefix).
SCALING_RAW_SUITE = SCALING_WORK + """
import json
import subprocess

SH = json.loads(os.environ["SMOLVM_BENCH_SH"])


@pytest.mark.parametrize("i", range(N))
def test_raw(i):
    assert subprocess.run([*SH, "-c", WORK], capture_output=True, text=True).stdout == "12000\\n"
"""

# Eval-shaped: small shell programs, each graded against its expected output. The isolated
# suite runs each in a fresh guest, the host suite with subprocess and no isolation at all.
EVAL_PROGRAMS = """
def program(i):
    kind = i % 5
    n = 15 + i % 40
    if kind == 0:  # fizzbuzz
        src = (f"i=1; while [ $i -le {n} ]; do if [ $((i%15)) -eq 0 ]; then echo FizzBuzz; "
               f"elif [ $((i%3)) -eq 0 ]; then echo Fizz; elif [ $((i%5)) -eq 0 ]; then echo Buzz; "
               f"else echo $i; fi; i=$((i+1)); done")
        want = "".join("FizzBuzz\\n" if k % 15 == 0 else "Fizz\\n" if k % 3 == 0 else "Buzz\\n" if k % 5 == 0
                       else f"{k}\\n" for k in range(1, n + 1))
    elif kind == 1:  # sum of squares
        src = f"s=0; i=1; while [ $i -le {n} ]; do s=$((s+i*i)); i=$((i+1)); done; echo $s"
        want = f"{sum(k * k for k in range(1, n + 1))}\\n"
    elif kind == 2:  # sort and count words
        words = " ".join(f"w{(k * 7919) % 13}" for k in range(n))
        src = f"for w in {words}; do echo $w; done | sort | uniq -c | wc -l"
        want = f"{len({(k * 7919) % 13 for k in range(n)})}\\n"
    elif kind == 3:  # file round trip in the working dir
        src = f"d=$(mktemp -d); seq 1 {n} > $d/in; tac $d/in | head -n 3 | tr '\\\\n' ' '; rm -r $d"
        want = " ".join(str(k) for k in range(n, n - 3, -1)) + " "
    else:  # fibonacci
        src = f"a=0; b=1; i=0; while [ $i -lt {n} ]; do t=$((a+b)); a=$b; b=$t; i=$((i+1)); done; echo $a"
        a, b = 0, 1
        for _ in range(n):
            a, b = b, a + b
        want = f"{a}\\n"
    return src, want
"""

EVAL_ISOLATED = EVAL_PROGRAMS + """
import os
import pytest


@pytest.mark.parametrize("i", range(int(os.environ["SMOLVM_BENCH_N"])))
def test_grade(smol_vm, i):
    src, want = program(i)
    result = smol_vm.exec(src, timeout=60)
    assert result.exit_code == 0 and result.stdout == want, result
"""

EVAL_HOST = EVAL_PROGRAMS + """
import os
import subprocess
import pytest


@pytest.mark.parametrize("i", range(int(os.environ["SMOLVM_BENCH_N"])))
def test_grade(i):
    src, want = program(i)
    result = subprocess.run(["/bin/sh", "-c", src], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == want, result
"""


def _pytest_wall(cfg: Config, suite: Path, n: int, extra: list[str], **more_env: str) -> float:
    env = {**cfg.env, "SMOLVM_BENCH_N": str(n), "PYTHONDONTWRITEBYTECODE": "1", **more_env}
    argv = [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
            "-o", "addopts=", "--rootdir", str(suite.parent), *extra]
    return wall(argv, env, suite.parent)


# In the suite's dir: the end of each test; the steady cost per test is the span from the end
# of the first to the end of the last over N - 1. Not to the end of the run: session end here
# is ~1 s of another plugin's terminal summary (hypothesis), nothing of ours (the pool's close,
# draining the teardown thread, is ~10 ms after 100 tests: no backlog builds up).
STEADY_CONFTEST = """
import json, os, time
import pytest

_finished = []


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # where the test ran, or in xdist's controller as it hears
        _finished.append(time.perf_counter())


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the controller's view, or the only process's
        with open(os.environ["SMOLVM_BENCH_OUT"], "w") as f:
            json.dump((_finished[-1] - _finished[0]) / (len(_finished) - 1), f)
"""


def _steady(measure: Callable[[Path], object], out: Path) -> float:
    """Seconds per item from the end of the first to the end of the last, timed inside the run.

    Not from whole-process walls: a pytest run's start-up here swings by hundreds of ms between
    identical runs, which (wall(2N) - wall(N)) / N spread over every test (1.12x and 2.28x in
    two full runs of the same tree). The first item (plan, zygote start) is left out, as the
    difference of walls left it out.
    """
    measure(out)
    return float(json.loads(out.read_text()))


def _kernel_floor(cfg: Config, iterations: int) -> float:
    return median(floor_times(cfg, iterations))


def bench_plugin_overhead(cfg: Config) -> list[Figure]:
    """The design ratio first: what a guest test costs in a real pytest run, against the floor."""
    suite_dir = cfg.root / "suite"
    suite_dir.mkdir()
    suite = suite_dir / "test_bench.py"
    suite.write_text(SUITE)
    n, reps = cfg.n(100, 40), cfg.n(5, 2)
    (suite_dir / "conftest.py").write_text(STEADY_CONFTEST)
    out = suite_dir / "steady.json"
    bare_script = str(HERE / "_bare.py")
    _pytest_wall(cfg, suite, max(n // 4, 2), [], SMOLVM_BENCH_OUT=str(out))  # warm-up: caches, bytecode
    floors: list[float] = []
    hardened: list[float] = []
    bare: list[float] = []
    plugin: list[float] = []
    for _ in range(reps):  # interleaved, the floor too: the host drifts by more than the margins
        floors.append(_kernel_floor(cfg, n))
        hardened.append(median(floor_times(cfg, n, guest_mounts=True)))
        bare.append(_steady(lambda o: run_checked([sys.executable, bare_script, str(n), str(o)], cfg.env, REPO), out))
        plugin.append(_steady(lambda o: _pytest_wall(cfg, suite, n, [], SMOLVM_BENCH_OUT=str(o)), out))
    floor = median(floors)
    force_rmtree(suite_dir)
    method = (f"per item from the end of the first to the end of the last, timed inside the run, N={n}, "
              f"median of {reps} interleaved runs")
    per_round = _spread([p / f for p, f in zip(plugin, floors, strict=True)])
    return [Figure(f'DESIGN RATIO: pytest test with smol_vm + exec("true") ({per_round})', median(plugin) * 1e3, "ms",
                   FLOOR, floor * 1e3, "<= 2x", None,
                   f"{method}; floor: in-process median per iteration, one batch per round"),
            Figure(f'  the same against a floor with the guest\'s /dev and masked /proc '
                   f'({_spread([p / f for p, f in zip(plugin, hardened, strict=True)])})', median(plugin) * 1e3, "ms",
                   FLOOR_WITH_GUEST_MOUNTS, median(hardened) * 1e3, "(none)", None,
                   f"{method}; floor: _floor.py guest-mounts, one batch per round"),
            Figure('pytest test with smol_vm + exec("true")', median(plugin) * 1e3, "ms",
                   "bare backend loop (subprocess)", median(bare) * 1e3, "<= 1.15x", None,
                   f"{method}, same method for both")]


PLAIN_SUITE = "def test_plain():\n    pass\n"


def bench_unused_plugin(cfg: Config) -> list[Figure]:
    """A project with the plugin installed and no guest test, on a cold cache, vs -p no:smolvm."""
    suite_dir = cfg.root / "plain"
    suite_dir.mkdir()
    suite = suite_dir / "test_plain.py"
    suite.write_text(PLAIN_SUITE)
    reps = cfg.n(3, 2)  # 3, not 5: the unisolated scaling suite took the time (5-minute budget)
    figures = []
    for label, extra, budget in (("serial", [], 60), ("-n 2", ["-n", "2"], 150)):
        with_plugin: list[float] = []
        without: list[float] = []
        first = 0 if label == "serial" else 1  # one warm-up run (rep 0) serves both labels
        for rep in range(first, reps + 1):
            for sink, flags in ((with_plugin, []), (without, ["-p", "no:smolvm"])):
                cold = cfg.root / f"cold-{label}-{rep}-{len(flags)}"
                env = {**cfg.env, "PYTEST_SMOLVM_STATE_DIR": str(cold / "state"),
                       "PYTEST_SMOLVM_CACHE_DIR": str(cold / "cache"), "XDG_CACHE_HOME": str(cold / "xdg")}
                started = time.perf_counter()
                run_checked([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider",
                             "-o", "addopts=", "--rootdir", str(suite_dir), *flags, *extra], env, suite_dir)
                if rep:
                    sink.append(time.perf_counter() - started)
                force_rmtree(cold)
        plugin, floor = median(with_plugin), median(without)
        figures.append(Figure(f"unused plugin, 1 plain test, {label} (+{(plugin - floor) * 1e3:.0f} ms; "
                              f"budget +{budget} ms)", plugin, "s", "same run with -p no:smolvm", floor,
                              f"<= {1 + budget / 1000 / floor:.2f}x", None,
                              f"median of {reps}, interleaved, a cold cache each run"))
    # Whole runs of pytest swing by hundreds of ms here, far more than the plugin's share: the
    # same cost measured where it is paid, importing the plugin inside a pytest run without it
    # (so what pytest has imported already, hashlib say, is not counted as ours).
    (suite_dir / "import_probe.py").write_text(IMPORT_PROBE)
    # Twice: as cached bytecode loads it, and as pytest's assertion rewriter compiles it afresh in
    # every run where it cannot cache its rewrite (PYTHONDONTWRITEBYTECODE, common in CI images,
    # or a read-only site-packages): it rewrites every module of an entry-point plugin.
    for label, rewrite in (("", ""), (", recompiled by pytest's rewriter", "1")):
        imported: list[float] = []
        runs: list[float] = []
        for rep in range(3):  # the import's spread is a few ms: three runs say it
            out = suite_dir / f"import-{rep}{rewrite}.json"
            env = {**cfg.env, "PYTHONPATH": str(suite_dir), "SMOLVM_BENCH_OUT": str(out),
                   "SMOLVM_BENCH_REWRITE": rewrite}
            runs.append(wall([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "-o",
                              "addopts=", "--rootdir", str(suite_dir), "-p", "no:smolvm", "-p", "import_probe"],
                             env, suite_dir))
            imported.append(json.loads(out.read_text()))
        plugin_s, run_s = median(imported), median(runs)
        figures.append(Figure(f"unused plugin, its import at startup{label} (+{plugin_s * 1e3:.1f} ms; "
                              "budget +60 ms)", plugin_s, "s", "the whole run without it", run_s,
                              f"<= {0.060 / run_s:.3f}x", None,
                              "median of 3: import pytest_smolvm.plugin.hooks timed inside a pytest run"))
    force_rmtree(suite_dir)
    return figures


IMPORT_PROBE = """
import json, os, time


def pytest_sessionstart(session):
    if os.environ.get("SMOLVM_BENCH_REWRITE"):
        import sys
        sys.dont_write_bytecode = True  # no cached rewrite: each module compiled, as in every such run
        session.config.pluginmanager.rewrite_hook.mark_rewrite("pytest_smolvm")
    started = time.perf_counter()
    import pytest_smolvm.plugin.hooks  # noqa: F401  (imported only: never registered in this run)
    with open(os.environ["SMOLVM_BENCH_OUT"], "w") as f:
        json.dump(time.perf_counter() - started, f)
"""


def _spread(values: list[float]) -> str:
    return f"median {median(values):.2f}, min {min(values):.2f}, max {max(values):.2f} over {len(values)} rounds"


def baseline_shell() -> list[str]:
    """argv that runs the default baseline's busybox sh on the host, unconfined, through its own loader."""
    from pytest_smolvm.baselines.baseline import resolve
    from pytest_smolvm.baselines.cache import unpack

    rootfs = unpack(resolve(None, REPO)).path
    loaders = sorted((rootfs / "lib").glob("ld-musl-*.so.1"))
    if not loaders:
        raise SystemExit(f"scaling: no musl loader under {rootfs}/lib to run the baseline's shell on the host")
    return [str(loaders[0]), "--library-path", str(rootfs / "lib"), str(rootfs / "bin" / "busybox"), "sh"]


def bench_scaling(cfg: Config) -> list[Figure]:
    """-n 2 over -n 1 on guest tests that each do a little CPU work, next to the same work unisolated."""
    suite_dir = cfg.root / "scaling"
    suite_dir.mkdir()
    guests = suite_dir / "test_scaling.py"
    guests.write_text(SCALING_SUITE)
    raw = suite_dir / "test_raw.py"
    raw.write_text(SCALING_RAW_SUITE)
    (suite_dir / "conftest.py").write_text(STEADY_CONFTEST)
    out = suite_dir / "steady.json"
    shell = json.dumps(baseline_shell())
    n, rounds = cfg.n(200, 60), cfg.n(3, 1)
    _pytest_wall(cfg, guests, n // 4, ["-n", "2"], SMOLVM_BENCH_OUT=str(out))  # warm-up
    # The unisolated suite's rate settles as fast in half the tests, and saves ~15 s of the budget.
    tests = {guests: n, raw: n // 2}
    rates: dict[tuple[Path, str], list[float]] = {(suite, w): [] for suite in (guests, raw) for w in ("1", "2")}
    for _ in range(rounds):
        for (suite, workers), sink in rates.items():
            # Throughput once running, as the controller hears the tests end (see _steady); the
            # lambda is called at once, so the loop variables it reads are the current ones.
            sink.append(1 / _steady(lambda o: _pytest_wall(cfg, suite, tests[suite], ["-n", workers],  # noqa: B023
                                                           SMOLVM_BENCH_OUT=str(o), SMOLVM_BENCH_SH=shell), out))
    force_rmtree(suite_dir)
    figures = []
    for suite, name, target in ((guests, "scaling -n 2 over -n 1", ">= 1.7x"),
                                (raw, "  same work unisolated (the baseline's sh on the host)", "")):
        one, two = rates[(suite, "1")], rates[(suite, "2")]
        speedups = [b / a for a, b in zip(one, two, strict=True)]
        figures.append(Figure(f"{name} ({_spread(speedups)})", median(two), "tests/s", "-n 1", median(one), target,
                              None, f"{tests[suite]} tests, each a ~30 ms busybox shell loop; tests per second from "
                              f"the end of the first to the end of the last, timed in the run; interleaved rounds; "
                              f"ratio of the medians"))
    return figures


def bench_eval(cfg: Config) -> list[Figure]:
    """The figure users care about: an eval suite graded in fresh guests vs run on the host unisolated."""
    suite_dir = cfg.root / "eval"
    suite_dir.mkdir()
    isolated = suite_dir / "test_isolated.py"
    isolated.write_text(EVAL_ISOLATED)
    host = suite_dir / "test_host.py"
    host.write_text(EVAL_HOST)
    n, rounds = 150, cfg.n(3, 1)
    for suite in (isolated, host):
        _pytest_wall(cfg, suite, 20, ["-n", "2"])  # warm-up, and a check that every program grades
    ours: list[float] = []
    floor: list[float] = []
    for _ in range(rounds):
        ours.append(_pytest_wall(cfg, isolated, n, ["-n", "2"]))
        floor.append(_pytest_wall(cfg, host, n, ["-n", "2"]))
    force_rmtree(suite_dir)
    ratios = [a / b for a, b in zip(ours, floor, strict=True)]
    return [Figure(f"eval suite, 150 shell programs, -n 2 ({_spread(ratios)})", median(ours), "s",
                   "same programs, subprocess on the host", median(floor), "<= 1.3x", None,
                   "whole-run wall of pytest -n 2, interleaved rounds, medians")]


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def _mem_available_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def bench_memory(cfg: Config) -> list[Figure]:
    count = 50
    pss_per, avail_per = [], []
    with backend_session() as (backend, baseline):
        new_guest(backend, baseline).destroy()  # the zygote exists before the "before" reading
        for _ in range(cfg.n(3, 1)):
            time.sleep(0.3)
            before = _mem_available_kb()
            guests = [new_guest(backend, baseline) for _ in range(count)]
            try:
                for guest in guests:
                    guest_exec(guest, ["true"])  # alive and served at least once
                time.sleep(0.5)
                after = _mem_available_kb()
                pss = sum(_pss_kb(p) for g in guests for p in _descendants(g.pid))
            finally:
                for guest in guests:
                    guest.destroy()
            pss_per.append(pss / count / 1024)
            avail_per.append((before - after) / count / 1024)
    return [Figure("host memory per idle VM (PSS, 50 alive)", median(pss_per), "MB", "", None, "<= 10 MB", None,
                   "sum of PSS over each guest's host processes / 50"),
            Figure("  cross-check: MemAvailable drop per VM", median(avail_per), "MB", "", None, "<= 10 MB", None,
                   "(MemAvailable before - with 50 alive) / 50; noisy, includes kernel objects")]


BENCHES: dict[str, Callable[[Config], list[Figure]]] = {
    "plugin": bench_plugin_overhead,  # first: the design ratio
    "unused": bench_unused_plugin,
    "baseline": bench_baseline,
    "floor": bench_floor_vs_bare,
    "exec": bench_exec,
    "copy": bench_copy,
    "scaling": bench_scaling,
    "eval": bench_eval,
    "memory": bench_memory,
}


def judge(fig: Figure) -> None:
    target = fig.target
    if target.startswith("<= ") and target.endswith("x") and fig.ratio is not None:
        fig.ok = fig.ratio <= float(target[3:-1])
    elif target.startswith(">= ") and target.endswith("x") and fig.ratio is not None:
        fig.ok = fig.ratio >= float(target[3:-1])
    elif target.startswith("<= ") and target.endswith(" MB"):
        fig.ok = fig.value <= float(target[3:-3])


def render(figures: list[Figure]) -> str:
    rows = [("figure", "value", "floor", "floor value", "ratio", "target", "ok")]
    for f in figures:
        floor = "" if f.floor is None else f"{f.floor:.3g} {f.unit}"
        rows.append((f.name, f"{f.value:.3g} {f.unit}", f.floor_name, floor,
                     "" if f.ratio is None else f"{f.ratio:.2f}x", f.target,
                     "" if f.ok is None else ("yes" if f.ok else "MISS")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def measured_package() -> Path:
    """The pytest_smolvm this run measures: the checkout this script sits in, or one named on
    PYTHONPATH (a worktree of another revision, for a before and after). Never a copy pip
    installed elsewhere: a CI run installs one into site-packages, and this script's
    ``sys.path[0]`` is benchmarks/, not the checkout, so it would measure that copy silently."""
    import pytest_smolvm

    package = Path(pytest_smolvm.__file__).resolve().parent
    named = [Path(entry).resolve() for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    roots = [HERE.parent.resolve(), *named]
    if not any(package.is_relative_to(root) for root in roots):
        sys.exit(f"benchmarks/run.py: pytest_smolvm imports from {package}, neither this checkout ({HERE.parent}) "
                 "nor PYTHONPATH: run 'pip install -e .' here, or name the tree to measure in PYTHONPATH")
    return package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and smaller suites")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHES)}")
    args = parser.parse_args()
    chosen = [b for b in args.only.split(",") if b] or list(BENCHES)
    unknown = set(chosen) - set(BENCHES)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")

    print(f"measuring pytest_smolvm from {measured_package()}", file=sys.stderr, flush=True)
    figures: list[Figure] = []
    started = time.monotonic()
    with bench_dirs(args.quick) as cfg:
        for name in chosen:
            t0 = time.monotonic()
            figures += BENCHES[name](cfg)
            print(f"[{name}: {time.monotonic() - t0:.1f}s]", file=sys.stderr, flush=True)
    for fig in figures:
        judge(fig)
    print(render(figures))
    print(f"(total {time.monotonic() - started:.0f}s, {os.cpu_count()} CPUs, {'quick' if args.quick else 'full'})")
    print("BENCH-JSON " + json.dumps({"quick": args.quick, "figures": [
        {**asdict(f), "ratio": f.ratio} for f in figures]}))


if __name__ == "__main__":
    main()
