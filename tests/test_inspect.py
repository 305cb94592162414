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

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "pip install 'pytest-smolvm[inspect]'  (inspect-ai>=0.3.285)"


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
# On the bundled Alpine baseline (BusyBox adduser); a warm setup makes the user once per host.
AGENT = SmolvmSandboxConfig(user="agent", setup=("adduser -D agent",))
CHECKS = sorted(name for name in dir(self_check) if name.startswith("test_"))


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory, shared_cache: Path,
           smol_engine_home: Path) -> Iterator[inspect_sandbox.SmolvmSandboxEnvironment]:
    """One sample's guest for every check, made and destroyed as Inspect does it."""
    state = tmp_path_factory.mktemp("smolvm-state")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_SMOLVM_STATE_DIR", str(state))
        mp.setenv("PYTEST_SMOLVM_CACHE_DIR", str(shared_cache))
        mp.setenv("XDG_CACHE_HOME", str(smol_engine_home / "c"))
        mp.setenv("XDG_DATA_HOME", str(smol_engine_home / "d"))
        cls = inspect_sandbox.SmolvmSandboxEnvironment
        asyncio.run(cls.task_init("selfcheck", AGENT))
        envs = asyncio.run(cls.sample_init("selfcheck", AGENT, {}))
        try:
            yield envs["default"].as_type(cls)
        finally:
            asyncio.run(cls.sample_cleanup("selfcheck", AGENT, envs, False))
            asyncio.run(cls.task_cleanup("selfcheck", AGENT, True))
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


def test_the_provider_registers_under_the_name_smolvm() -> None:
    from inspect_ai._util.registry import registry_find
    from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

    assert registry_find_sandboxenv("smolvm") is inspect_sandbox.SmolvmSandboxEnvironment
    del registry_find


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
