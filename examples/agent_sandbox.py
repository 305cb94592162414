"""Wrapping one smol_vm guest in an agent framework's sandbox interface.

Agent frameworks ask a sandbox for a few async calls: run a command (argv, stdin, cwd, env,
user, timeout), write a file, read a file; they branch on a result's return code and on
standard exceptions (TimeoutError, FileNotFoundError, PermissionError, IsADirectoryError).
This adapter has the shape of inspect_ai's ``SandboxEnvironment`` without depending on it:
replace ``SandboxResult`` with the framework's own result type and subclass its base class.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_smolvm import VM

READ_LIMIT = 100 << 20  # what the framework promises to read at most


@dataclass(frozen=True)
class SandboxResult:
    success: bool
    returncode: int
    stdout: str
    stderr: str


class OutputLimitExceededError(Exception):
    """The command wrote more than the guest's output limit (``smol(output_limit=...)``)."""


class SmolSandbox:
    """An agent's sandbox backed by a pytest-smolvm guest: every call goes to ``vm.aio``."""

    def __init__(self, vm: VM) -> None:
        self.vm = vm

    async def exec(self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None,
                   timeout: float | None = None) -> SandboxResult:
        try:
            # timeout=None is "no limit" (omitting it would mean the marker's default).
            result = await self.vm.aio.exec(cmd, stdin=input, workdir=cwd, env=env, user=user, timeout=timeout)
        except (FileNotFoundError, PermissionError) as exc:
            # Frameworks expect a shell-like status for a program that cannot start.
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            return SandboxResult(False, code, "", f"{cmd[0]}: {exc.strerror}\n")
        if result.timed_out:
            raise TimeoutError(f"command timed out after {timeout} s: {result.command}")
        if result.truncated:
            raise OutputLimitExceededError(f"{' and '.join(result.truncated)} over the output limit")
        return SandboxResult(result.ok, result.exit_code, result.stdout, result.stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        await self.vm.aio.write_file(file, contents)  # relative paths: from the guest's workdir

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        data = await self.vm.aio.read_file(file, max_bytes=READ_LIMIT)
        return data.decode("utf-8") if text else data  # UnicodeDecodeError, as frameworks expect
