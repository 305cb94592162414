"""One decision per run, made lazily by the process that outlives the others (issue 10).

- Installing the plugin costs a project without guest tests nothing: no probe, no file, no
  process, no signal handler, no report line (serially and under xdist).
- Under xdist, workers never decide: they use the controller's plan even when their own
  environment would make them decide otherwise.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

NO_GUEST_SUITE = """
import signal, sys

def test_plain():
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL

def test_nothing_heavy_was_imported():
    heavy = [m for m in ("smol", "pytest_smolvm.session.pool", "pytest_smolvm.session.plan", "pytest_smolvm.backends",
                         "pytest_smolvm.handle.vm", "zstandard") if m in sys.modules]
    assert heavy == []

def test_nor_the_parts_a_guest_test_needs():
    # Each costs its import (its compile, where bytecode cannot be cached): these stay unloaded.
    unused = [m for m in ("pytest_smolvm.evals.episodes", "pytest_smolvm.plugin.concurrency",
                          "pytest_smolvm.plugin.artifacts", "pytest_smolvm.plugin.premade",
                          "pytest_smolvm.plugin.reporting") if m in sys.modules]
    assert unused == []
"""


def _files_under(*roots: Path) -> list[str]:
    return sorted(str(p) for root in roots if root.exists() for p in root.rglob("*"))


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "n2"])
def test_an_unused_plugin_does_nothing(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path, workers: list[str]) -> None:
    cache, state, xdg = tmp_path / "cache", tmp_path / "state", tmp_path / "xdg"
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    monkeypatch.setenv("PYTEST_SMOLVM_STATE_DIR", str(state))
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(xdg / "data"))
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    pytester.makepyfile(NO_GUEST_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *workers)
    result.assert_outcomes(passed=3)
    out = result.stdout.str().replace("plugins: smolvm-", "plugins: ")  # pytest's own plugin list
    assert "smolvm" not in out  # no header line, no summary section
    assert _files_under(cache, state, xdg) == []  # no probe cache, no registry, no unpacked baseline


def test_pytest_rewrites_the_asserts_of_none_of_the_plugins_modules(pytester: pytest.Pytester,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest marks the whole package for rewriting where it is installed as a regular package
    # (CI's install), not where it is editable (a developer's): marked here by hand as pytest
    # marks it, then loaded as a plugin, and a guest test's parts imported through the hook.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest("""
        import pytest
        pytest.register_assert_rewrite("pytest_smolvm")
        pytest_plugins = ["pytest_smolvm.plugin.hooks"]
    """)
    pytester.makepyfile("""
        import sys
        from _pytest.assertion.rewrite import AssertionRewritingHook

        def test_loaders():
            import pytest_smolvm.session.pool, pytest_smolvm.plugin.concurrency
            rewritten = sorted(name for name, module in sys.modules.items() if name.startswith("pytest_smolvm")
                               and isinstance(getattr(module, "__loader__", None), AssertionRewritingHook))
            # At most the package's own __init__ (which unmarks the rest; an editable install's
            # comes by another finder) and the module named in pytest_plugins, marked by name.
            assert set(rewritten) <= {"pytest_smolvm", "pytest_smolvm.plugin.hooks"}, rewritten
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_plan_is_made_when_the_first_guest_is_asked_for(pytester: pytest.Pytester, smol_state: Path,
                                                            shared_cache: Path) -> None:
    pytester.makepyfile("""
        import sys
        from pathlib import Path
        import os

        def test_a_plain_test_first():
            assert "pytest_smolvm.session.plan" not in sys.modules
            assert not (Path(os.environ["PYTEST_SMOLVM_STATE_DIR"]) / "registry").exists()

        def test_then_a_guest(smol_vm):
            assert smol_vm.exec("true").exit_code == 0
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*= smolvm =*", "smolvm: backend namespace (isolation: namespace;*",
                                 "smolvm: baseline bundled alpine (bundled, sha256:*"])


FILELOCK_SEEN_CONFTEST = """
import os, sys

def pytest_unconfigure(config):
    worker = getattr(config, "workerinput", {}).get("workerid", "controller")
    with open(os.environ["SMOLVM_TEST_SEEN"], "a") as f:
        f.write(f"{worker} {'filelock' in sys.modules}\\n")
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "n2"])
def test_a_run_after_the_hosts_first_never_imports_filelock(pytester: pytest.Pytester, smol_state: Path,
                                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            workers: list[str]) -> None:
    """filelock guards a host's first unpack of a baseline (and its first probe); every later run
    finds both done and skips its import, ~16 ms on the way to the first guest, in every process."""
    seen = tmp_path / "seen"
    monkeypatch.setenv("SMOLVM_TEST_SEEN", str(seen))
    pytester.makeconftest(FILELOCK_SEEN_CONFTEST)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(2))
        def test_a_guest(smol_vm, i):
            assert smol_vm.exec("true").exit_code == 0
    """)
    pytester.runpytest_subprocess("-p", "no:randomly", *workers).assert_outcomes(passed=2)  # the host's first
    seen.unlink()
    pytester.runpytest_subprocess("-p", "no:randomly", *workers).assert_outcomes(passed=2)
    lines = sorted(seen.read_text().splitlines())
    assert lines == (["controller False", "gw0 False", "gw1 False"] if workers else ["controller False"])


WORKERS_DIFFER_CONFTEST = """
import os
from pathlib import Path

def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    # A worker whose own view of the host differs from the controller's: its probe cache says a
    # microVM boots (a worker deciding for itself would pick smol), and the environment variable
    # xdist also sets names another worker.
    from pytest_smolvm.backends.smol import probe
    cache = Path(os.environ["PYTEST_SMOLVM_CACHE_DIR"]) / ("forged-" + workerinput["workerid"])
    os.environ["PYTEST_SMOLVM_CACHE_DIR"] = str(cache)
    probe._store(probe.cache_key(), probe.BootReport(True, "forged by the test", 0.0))
    os.environ["PYTEST_XDIST_WORKER"] = "bogus"
"""


def test_workers_use_the_controllers_plan_whatever_their_environment(pytester: pytest.Pytester,
                                                                     smol_state: Path) -> None:
    pytester.makeconftest(WORKERS_DIFFER_CONFTEST)
    pytester.makepyfile("""
        import os
        import pytest

        @pytest.mark.parametrize("i", range(6))
        def test_guest(smol_vm, i, worker_id):
            assert smol_vm.backend == "namespace"
            assert f"-{worker_id}-" in smol_vm.name and "bogus" not in smol_vm.name
            print("DIGEST", smol_vm.digest)
    """)
    result = pytester.runpytest_subprocess("-n", "2", "-s", "-rA")
    result.assert_outcomes(passed=6)
    digests = {line.split()[-1] for line in result.stdout.lines if "DIGEST sha256:" in line}
    assert len(digests) <= 1  # one baseline for the whole run (xdist may swallow -s output)
    result.stdout.fnmatch_lines(["smolvm: backend namespace (isolation: namespace;*"])


def test_a_bad_baseline_is_one_error_and_the_run_stops(pytester: pytest.Pytester, smol_state: Path,
                                                       tmp_path: Path) -> None:
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"not a tar at all" * 100)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(5))
        def test_guest(smol_vm, i):
            pass
    """)
    result = pytester.runpytest_subprocess(f"--smol-baseline={broken}")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*--smol-baseline={broken}: *"])
    assert "Traceback" not in result.stdout.str()


def test_a_backend_close_that_raises_is_reported_not_an_internal_error(
        pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makeconftest("""
        from pytest_smolvm.backends.namespace.backend import NamespaceBackend

        original = NamespaceBackend.close

        def close(self):
            original(self)
            raise RuntimeError("the engine refused to close")

        NamespaceBackend.close = close
    """)
    pytester.makepyfile("def test_guest(smol_vm):\n    assert smol_vm.exec('true').exit_code == 0\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["*teardown problem*RuntimeError: the engine refused to close*"])


def test_a_hanging_destroy_is_bounded_and_left_to_the_reaper(smol_state: Path) -> None:
    import threading

    from pytest_smolvm import SmolVMWarning
    from pytest_smolvm.host import registry
    from pytest_smolvm.session.plan import Planner
    from pytest_smolvm.session.pool import GuestPool
    from pytest_smolvm.session.settings import MarkerSpec, Settings

    planner = Planner(Settings(backend="namespace"), "r" * 32, "main")
    pool = GuestPool(Settings(backend="namespace"), planner, run_id="r" * 32, worker="main")
    live = pool.create("test_hang", MarkerSpec())
    release = threading.Event()
    real_destroy = live.guest.destroy

    def hang() -> None:
        release.wait(30)

    live.guest.destroy = hang  # type: ignore[method-assign]
    pool.destroy_timeout = 0.5
    with pytest.warns(SmolVMWarning, match="did not finish within 0.5s"):
        assert pool.destroy(live) is False
    # The record stays for the reaper (beside the guest the pool made ahead for a next test).
    assert [r.name for r in registry.records() if r.test_id == "test_hang"] == [live.vm.name]
    release.set()
    real_destroy()
    live.record.remove()
    assert pool.close() == [] and planner.close() == []


def test_probe_answers_hold_while_their_key_does_and_sdk_set_variables_do_not_change_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pytest_smolvm.backends.base import ProbeResult
    from pytest_smolvm.backends.smol import probe
    from pytest_smolvm.backends.smol.boot_failures import TIMEOUT_REASON

    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SMOLVM_SECCOMP", raising=False)
    key = probe.cache_key()
    monkeypatch.setenv("SMOLVM_SECCOMP", "enforce")  # what `import smol` does to os.environ
    monkeypatch.setenv("SMOLVM_LANDLOCK", "enforce")
    assert probe.cache_key() == key
    probe._store(key, probe.BootReport(False, "KvmContext(KvmOpen(Error(13)))", 0.3))
    probe._store("stalled", probe.BootReport(False, f"{TIMEOUT_REASON} 20s", 20.0, timed_out=True))
    assert probe._load_cached(key) == ProbeResult(False, "KvmContext(KvmOpen(Error(13)))")
    later = time.time() + 7 * 24 * 3600  # a week on, the same boot: nothing the key sees has changed
    monkeypatch.setattr(time, "time", lambda: later)  # the time module probe reads the clock from
    # A refusal holds: re-probing would add seconds to some test of every run (doctor re-probes).
    assert probe._load_cached(key) == ProbeResult(False, "KvmContext(KvmOpen(Error(13)))")
    assert probe._load_cached("stalled") is None  # a stall may have been the engine's slow first start
    probe._store(key, probe.BootReport(True, "booted", 0.1))
    assert probe._load_cached(key) == ProbeResult(True, "booted")


def test_liveness_without_proc_uses_ps(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS has no /proc: a live owner must still look alive there, and a dead one dead."""
    import subprocess
    import sys

    from pytest_smolvm.host import procs

    monkeypatch.setattr(procs, "HAVE_PROC", False)
    me = procs.process_start_time(os.getpid())
    assert me is not None and procs.is_alive(os.getpid(), me)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert procs.process_start_time(child.pid) is None
    assert not procs.is_alive(os.getpid(), me - 3600)  # same pid, another start: a reused pid


def test_a_run_whose_only_guest_failed_to_provision_still_says_what_it_decided(pytester: pytest.Pytester,
                                                                                smol_state: Path) -> None:
    """The backend and baseline lines were printed only when a test had used a guest: a run
    whose one guest test errored in setup (its warm baseline's command failed) said nothing of
    the backend or baseline it had chosen, which is what its user needs to read first."""
    pytester.makeconftest("""
        import pytest

        @pytest.fixture(scope="session")
        def smol_baseline_setup():
            return ["echo warming; exit 3"]
    """)
    pytester.makepyfile("""
        def test_guest(smol_vm):
            pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*= smolvm =*", "smolvm: backend namespace (isolation: namespace;*",
                                 "smolvm: baseline *"])
