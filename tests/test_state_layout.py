"""Where records live: a namespace guest's in the runtime dir (a tmpfs, gone at reboot with the
guest), every other backend's in the state dir (a smol machine outlives the host's boot)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.host import registry
from pytest_smolvm.host.paths import runtime_dir, state_dir
from tests.leaks import assert_host_clean


@pytest.fixture
def split_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, Path]:
    """No PYTEST_SMOLVM_STATE_DIR: the default layout, with its two roots under tmp_path."""
    monkeypatch.delenv("PYTEST_SMOLVM_STATE_DIR", raising=False)
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "run" / "pytest-smolvm", tmp_path / "state" / "pytest-smolvm"


def test_runtime_dir_follows_the_xdg_runtime_dir(split_dirs: tuple[Path, Path]) -> None:
    runtime, state = split_dirs
    assert (runtime_dir(), state_dir()) == (runtime, state)


def test_an_explicit_state_dir_holds_everything(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("PYTEST_SMOLVM_STATE_DIR", str(tmp_path / "one"))
    assert runtime_dir() == state_dir() == tmp_path / "one"


def test_without_any_tmpfs_the_state_dir_holds_everything(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    monkeypatch.delenv("PYTEST_SMOLVM_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr("pytest_smolvm.host.paths._is_tmpfs", lambda path: False)  # no /run, no /dev/shm
    assert runtime_dir() == state_dir() == tmp_path / "pytest-smolvm"


def test_a_shared_tmpfs_dir_is_used_only_if_it_is_ours_alone(tmp_path: Path) -> None:
    """/dev/shm is writable by every user: what another user planted there is never used."""
    from pytest_smolvm.host.paths import _own_private_dir

    euid = os.geteuid()
    made = _own_private_dir(str(tmp_path / "fresh"), euid)
    assert made == tmp_path / "fresh" and stat.S_IMODE(made.stat().st_mode) == 0o700
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "planted-link").symlink_to(tmp_path / "elsewhere")
    assert _own_private_dir(str(tmp_path / "planted-link"), euid) is None
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o755)
    assert _own_private_dir(str(tmp_path / "open"), euid) is None
    (tmp_path / "theirs").mkdir(mode=0o700)
    assert _own_private_dir(str(tmp_path / "theirs"), euid + 1) is None
    (tmp_path / "a-file").write_text("")
    assert _own_private_dir(str(tmp_path / "a-file"), euid) is None


def test_without_a_session_runtime_dir_a_tmpfs_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pytest_smolvm.host.paths import _is_tmpfs

    monkeypatch.delenv("PYTEST_SMOLVM_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    found = runtime_dir()
    if os.geteuid() == 0 and _is_tmpfs("/run"):
        assert found == Path("/run/pytest-smolvm")
    elif _is_tmpfs("/dev/shm"):
        assert found == Path(f"/dev/shm/pytest-smolvm-{os.geteuid()}")
    else:
        assert found == tmp_path / "pytest-smolvm"
    assert not _is_tmpfs(str(tmp_path)) or found != tmp_path / "pytest-smolvm"


def test_the_namespace_backend_is_host_bound() -> None:
    assert NamespaceBackend.name in registry.HOST_BOUND_BACKENDS


def test_records_are_found_and_removed_in_either_dir(split_dirs: tuple[Path, Path]) -> None:
    runtime, state = split_dirs
    local = registry.Record.for_this_process("local-1", "namespace", "run", "main", "t::a")
    remote = registry.Record.for_this_process("remote-1", "smol", "run", "main", "t::b")
    local.save()
    remote.save()
    assert (runtime / "registry" / "local-1.json").exists() and (state / "registry" / "remote-1.json").exists()
    assert sorted(r.name for r in registry.records()) == ["local-1", "remote-1"]
    # A namespace record an older version saved in the state dir is still found, and removed.
    (state / "registry" / "old-1.json").write_text((runtime / "registry" / "local-1.json").read_text()
                                                   .replace("local-1", "old-1"))
    old = next(r for r in registry.records() if r.name == "old-1")
    for record in (local, remote, old):
        record.remove()
    assert list(registry.records()) == []


def test_a_run_keeps_namespace_records_and_scratch_in_the_runtime_dir(
        pytester: pytest.Pytester, split_dirs: tuple[Path, Path], shared_cache: Path, smol_engine_home: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, state = split_dirs
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(shared_cache))
    monkeypatch.setenv("XDG_CACHE_HOME", str(smol_engine_home / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(smol_engine_home / "d"))
    pytester.makepyfile(test_records=f"""
        from pathlib import Path

        def test_records(smol_vm):
            assert smol_vm.name in [p.stem for p in Path({str(runtime)!r}, "registry").glob("*.json")]
            assert Path({str(runtime)!r}, "scratch", smol_vm.name).is_dir()
            assert not Path({str(state)!r}, "registry").exists()
    """)
    pytester.runpytest_subprocess("test_records.py").assert_outcomes(passed=1)
    listing = subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", "ls"], capture_output=True, text=True,
                             env=os.environ.copy(), timeout=60)
    assert listing.stdout.strip() == "no guests recorded", listing
    assert_host_clean(runtime)
    # Killed: its helper finds the guest's record in the runtime dir and removes it with the rest.
    pytester.makepyfile(test_crash="""
        import os, signal

        def test_crash(smol_vm):
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert pytester.runpytest_subprocess("test_crash.py").ret == -signal.SIGKILL
    assert_host_clean(runtime)


def test_a_save_cut_in_half_by_a_dead_writer_is_swept_by_the_reaper(split_dirs: tuple[Path, Path]) -> None:
    """A pytest killed with its helper in the middle of a save leaves the save's temp file: the
    next reap removes it, and never the temp file of a save still under way."""
    from pytest_smolvm.session import reaper

    runtime, _ = split_dirs
    (runtime / "registry").mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    cut = runtime / "registry" / f".smol-x-main-3.{dead.pid}.tmp"
    under_way = runtime / "registry" / f".smol-x-main-4.{os.getpid()}.tmp"
    for path in (cut, under_way):
        path.write_text("{")
    reaper.reap_orphans()
    assert not cut.exists() and under_way.exists()


def test_the_sweep_leaves_another_hosts_saves_in_a_shared_state_dir(split_dirs: tuple[Path, Path]) -> None:
    """A state dir shared between hosts (NFS, a CI volume) holds other hosts' saves under way:
    their writer's pid means nothing here, however dead it looks."""
    from pytest_smolvm.host import registry
    from pytest_smolvm.session import reaper

    _, state = split_dirs
    record = registry.Record.for_this_process("smol-x-main-5", "smol", "run", "main", "t")
    record.save()
    dead = subprocess.Popen(["true"])
    dead.wait()
    ours = f".smol-x-main-6.{dead.pid}@{registry._host_tag()}.tmp"
    theirs = f".smol-x-main-7.{dead.pid}@0123456789ab.tmp"
    for name in (ours, theirs):
        (state / "registry" / name).write_text("{")
    reaper.reap_orphans()
    assert not (state / "registry" / ours).exists()
    assert (state / "registry" / theirs).exists()
    assert sorted(p.name for p in (state / "registry").iterdir()) == [theirs, "smol-x-main-5.json"]
