"""The Inspect AI sandbox provider ``smolvm`` (docs/agents.md), checked by Inspect's own suite."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.leaks import assert_host_clean
from tests.test_lifecycle import KILL_HELPER_AND_SELF

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "python3 -m pip install '.[inspect]' from a checkout (inspect-ai>=0.3.285, Python 3.11+)"


def test_the_plugin_and_a_pytest_run_import_nothing_of_inspect(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    code = ("import sys, pytest, pytest_smolvm.plugin.hooks, pytest_smolvm\n"
            f"rc = pytest.main(['-q', '-p', 'no:cacheprovider', {str(tmp_path)!r}])\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('inspect_ai', 'pydantic'))\n"
            "assert rc == 0 and not bad, (rc, bad[:5])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


inspect_ai = pytest.importorskip("inspect_ai", reason=f"the smolvm Inspect provider needs {INSTALL}")

from inspect_ai.util._sandbox import self_check  # noqa: E402

from pytest_smolvm.errors import UsageError  # noqa: E402
from pytest_smolvm.integrations import inspect_sandbox  # noqa: E402
from pytest_smolvm.integrations.inspect_config import SmolvmSandboxConfig, load  # noqa: E402

# A non-root default user, as the issue asks: Inspect's permission checks cannot fail for root.
# On the bundled Alpine baseline (BusyBox adduser) and on Debian (shadow's useradd, which opens the
# audit socket: the seccomp filter answers it as Podman's does). A warm setup makes the user once.
AGENT = SmolvmSandboxConfig(user="agent", setup=("adduser -D agent",))
CHECKS = sorted(name for name in dir(self_check) if name.startswith("test_"))


def _config(baseline: str) -> SmolvmSandboxConfig:
    if baseline == "alpine":
        return AGENT
    from tests.debian import debian_rootfs

    return SmolvmSandboxConfig(baseline=str(debian_rootfs()), user="agent", setup=("useradd -m agent",))


@pytest.fixture(scope="module", params=["alpine", "debian"])
def sample(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, shared_cache: Path,
           smol_engine_home: Path) -> Iterator[inspect_sandbox.SmolvmSandboxEnvironment]:
    """One sample's guest for every check, made and destroyed as Inspect does it."""
    config = _config(request.param)
    state = tmp_path_factory.mktemp("smolvm-state")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_SMOLVM_STATE_DIR", str(state))
        mp.setenv("PYTEST_SMOLVM_CACHE_DIR", str(shared_cache))
        mp.setenv("XDG_CACHE_HOME", str(smol_engine_home / "c"))
        mp.setenv("XDG_DATA_HOME", str(smol_engine_home / "d"))
        cls = inspect_sandbox.SmolvmSandboxEnvironment
        asyncio.run(cls.task_init("selfcheck", config))
        envs = asyncio.run(cls.sample_init("selfcheck", config, {}))
        try:
            yield envs["default"].as_type(cls)
        finally:
            asyncio.run(cls.sample_cleanup("selfcheck", config, envs, False))
            asyncio.run(cls.task_cleanup("selfcheck", config, True))
        assert_host_clean(state)


def test_inspect_has_44_checks() -> None:
    assert len(CHECKS) == 44, CHECKS


@pytest.mark.parametrize("check", CHECKS)
def test_inspect_self_check(check: str, sample: Any) -> None:
    asyncio.run(getattr(self_check, check)(sample))


def test_commands_and_files_run_as_the_configured_user(sample: Any) -> None:
    async def check() -> None:
        assert (await sample.exec(["id", "-un"])).stdout == "agent\n"
        await sample.write_file("mine.txt", "x")  # the sample's working dir is the user's
        owner = await sample.exec(["stat", "-c", "%U %n", "mine.txt"])
        assert owner.stdout == "agent mine.txt\n", owner
        assert (await sample.exec(["pwd"])).stdout == "/workspace\n"
    asyncio.run(check())


def test_inspect_finds_the_provider_by_its_entry_point() -> None:
    """In a fresh process that never imports pytest_smolvm: only the entry point can register it."""
    code = ("import sys\n"
            "from inspect_ai.util._sandbox.registry import registry_find_sandboxenv\n"
            "assert 'pytest_smolvm' not in sys.modules\n"
            "cls = registry_find_sandboxenv('smolvm')\n"
            "print(cls.__module__, cls.__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "pytest_smolvm.integrations.inspect_sandbox SmolvmSandboxEnvironment\n", done.stderr


def test_exec_output_past_inspect_s_limit_is_output_limit_exceeded(sample: Any) -> None:
    from inspect_ai.util import OutputLimitExceededError, SandboxEnvironmentLimits

    over = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE + 1024
    with pytest.raises(OutputLimitExceededError) as raised:
        asyncio.run(sample.exec(["sh", "-c", f"head -c {over} /dev/zero | tr '\\0' x"]))
    assert raised.value.limit_str == SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR
    kept = raised.value.truncated_output or ""  # the stream's head and tail: only bytes the guest wrote
    assert kept == "x" * SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE, kept[-200:]


def test_default_concurrency_is_two_per_core_capped_by_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from pytest_smolvm.limits import LIMITS

    cls = inspect_sandbox.SmolvmSandboxEnvironment
    cores = len(os.sched_getaffinity(0))
    page = os.sysconf("SC_PAGE_SIZE")
    free_mb = {"mb": 1 << 20}

    def sysconf(name: str) -> int:
        return free_mb["mb"] * (1 << 20) // page if name == "SC_AVPHYS_PAGES" else page

    monkeypatch.setattr(os, "sysconf", sysconf)
    assert cls.default_concurrency() == 2 * cores
    free_mb["mb"] = LIMITS.inspect_guest_memory_mb * 2 + 1  # room for two guests, whatever the cores
    assert cls.default_concurrency() == min(2, 2 * cores)
    free_mb["mb"] = 10  # not even one: still one at a time, never zero
    assert cls.default_concurrency() == 1


def test_named_environments_are_separate_guests_and_a_failed_sample_init_leaves_none(
        smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = inspect_sandbox.SmolvmSandboxEnvironment
    config = SmolvmSandboxConfig(environments=("default", "peer"))

    async def scenario() -> None:
        await cls.task_init("startup", config)
        envs = await cls.sample_init("pair", config, {})
        try:
            assert list(envs) == ["default", "peer"]
            await envs["default"].write_file("only-here.txt", "x")
            seen = await envs["peer"].exec(["ls", "/workspace"])
            assert seen.success and seen.stdout == "", seen
        finally:
            await cls.sample_cleanup("pair", config, envs, False)
        session = inspect_sandbox._sessions[config.model_dump_json()]
        assert session._live == {}
        # The second guest fails to start: the first is destroyed before the error goes up.
        acreate, calls = session.acreate, []

        async def second_fails(label: str = "", **keywords: Any) -> Any:
            calls.append(label)
            if len(calls) == 2:
                raise RuntimeError("injected: no second guest")
            return await acreate(label, **keywords)

        monkeypatch.setattr(session, "acreate", second_fails)
        with pytest.raises(RuntimeError, match="injected"):
            await cls.sample_init("pair", config, {})
        assert calls == ["pair:default", "pair:peer"] and session._live == {}
        await cls.task_cleanup("shutdown", config, True)
        assert config.model_dump_json() not in inspect_sandbox._sessions

    asyncio.run(scenario())


OWNER = KILL_HELPER_AND_SELF + """
from pytest_smolvm import Session

vm = Session(backend="namespace").create("doomed")
print(vm.name, flush=True)
kill_helper_and_self()  # the helper too: else it cleans up after its owner, with no reaper needed
"""


def test_inspect_sandbox_cleanup_smolvm_removes_a_killed_eval_s_guests(smol_state: Path) -> None:
    from pytest_smolvm.host.registry import records

    owner = subprocess.run([sys.executable, "-c", OWNER], capture_output=True, text=True, timeout=120)
    name = owner.stdout.strip()
    assert owner.returncode == -9 and name in [r.name for r in records()], owner.stderr
    done = subprocess.run([sys.executable, "-m", "inspect_ai", "sandbox", "cleanup", "smolvm"],
                          input="y\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [r.name for r in records()] == []


def test_a_bad_config_key_is_one_line_naming_key_and_file(tmp_path: Path) -> None:
    toml = tmp_path / "smolvm.toml"
    toml.write_text('baseline = "alpine"\nmemroy_mb = 512\n')
    with pytest.raises(UsageError, match=rf"^{toml}: unknown key 'memroy_mb' \(expected one of baseline, "):
        load(str(toml))
    toml.write_text("memory_mb = 'lots'\n")
    with pytest.raises(UsageError, match=rf"^{toml}: key 'memory_mb': "):
        load(str(toml))
    toml.write_text('baseline = "x"\nmemory_mb = 512\nuser = "agent"\n')
    config = load(str(toml))
    assert config == SmolvmSandboxConfig(baseline="x", memory_mb=512, user="agent")
    assert config.guest_keywords() == {"memory_mb": 512, "user": "agent"}
