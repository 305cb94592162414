"""The agent-sandbox adapter (agent_sandbox.py) on a real guest: what a framework's checks ask of it.

The tests drive the async adapter with asyncio.run; with pytest-asyncio or anyio's plugin they
would be ``async def`` tests awaiting the same calls.
"""

import asyncio
import time

import pytest
from agent_sandbox import OutputLimitExceededError, SmolSandbox

from pytest_smolvm import VM


def test_exec_files_and_errors(smol_vm: VM) -> None:
    sandbox = SmolSandbox(smol_vm)

    async def episode() -> None:
        await sandbox.write_file("/workspace/task.txt", "reverse me\n")
        result = await sandbox.exec(["sh", "-c", "rev task.txt"], cwd="/workspace")
        assert (result.success, result.stdout) == (True, "em esrever\n")
        assert (await sandbox.exec(["no-such-tool"])).returncode == 127
        with pytest.raises(FileNotFoundError):
            await sandbox.read_file("/workspace/missing.txt")
        with pytest.raises(IsADirectoryError):
            await sandbox.read_file("/workspace")
        with pytest.raises(TimeoutError):
            await sandbox.exec(["sleep", "10"], timeout=0.5)
        big = "x" * 120_000  # a long prompt passed as one argument (the kernel allows 128 KiB)
        assert (await sandbox.exec(["sh", "-c", 'echo ${#1}', "sh", big])).stdout == "120000\n"

    asyncio.run(episode())


def test_unprivileged_agent_user(smol_vm: VM) -> None:
    sandbox = SmolSandbox(smol_vm)
    smol_vm.exec("echo secret > /root/key && chmod 600 /root/key", check=True)

    async def episode() -> None:
        denied = await sandbox.exec(["cat", "/root/key"], user="nobody")
        assert not denied.success and "Permission denied" in denied.stderr
        assert (await sandbox.exec(["id", "-un"], user="nobody")).stdout == "nobody\n"

    asyncio.run(episode())


def test_tool_calls_run_concurrently(smol_vm: VM) -> None:
    sandbox = SmolSandbox(smol_vm)

    async def episode() -> float:
        started = time.monotonic()
        results = await asyncio.gather(*(sandbox.exec(["sh", "-c", f"sleep 1; echo {i}"]) for i in range(3)))
        assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]
        return time.monotonic() - started

    assert asyncio.run(episode()) < 2.5  # three 1 s calls, not 3 s in a row


@pytest.mark.smol(output_limit="4k")
@pytest.mark.filterwarnings("ignore:smolvm. exec .* cut at the output limit")  # the cut is this test's point
def test_output_limit_is_an_error_the_agent_sees(smol_vm: VM) -> None:
    with pytest.raises(OutputLimitExceededError, match="stdout"):
        asyncio.run(SmolSandbox(smol_vm).exec(["head", "-c", "100000", "/dev/zero"]))
