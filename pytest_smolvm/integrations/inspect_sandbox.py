"""The Inspect AI sandbox provider ``smolvm``: a fresh guest per sample, made by a Session.

Inspect loads this module through the ``inspect_ai`` entry point; nothing else imports it, so
pytest runs and library users pay nothing for it. Guests come only from
:class:`pytest_smolvm.session.library.Session` (one per sandbox config), so
their lifecycle, registry records and reaping are the plugin's own.
"""

from __future__ import annotations

import errno
import os
import posixpath
from typing import Any, Literal, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from pydantic import BaseModel
from typing_extensions import override

from pytest_smolvm import limits
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.integrations.inspect_config import SmolvmSandboxConfig, load
from pytest_smolvm.session.library import Session

WORKDIR = "/workspace"  # the sample's working directory, made writable by the config's user

# One per config: task_init makes it, task_cleanup closes it. Not per task: Inspect calls those
# two once per config for the whole eval, with the names "startup" and "shutdown".
_sessions: dict[str, Session] = {}


def _session(config: SmolvmSandboxConfig) -> Session:
    key = config.model_dump_json()
    session = _sessions.get(key)
    if session is None:  # sample_init without task_init (Inspect's own checks do this)
        session = _sessions[key] = Session(baseline=config.baseline, setup=config.setup,
                                           output_limit=SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE)
    return session


@sandboxenv(name="smolvm")
class SmolvmSandboxEnvironment(SandboxEnvironment):
    """One guest of a sample; see the module docstring and docs/agents.md."""

    def __init__(self, vm: VM, session: Session, user: str | int | None) -> None:
        super().__init__()
        self.vm = vm
        self._session = session
        self._user = user

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def config_files(cls) -> list[str]:
        return ["smolvm.toml"]

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return load(config)

    @classmethod
    def default_concurrency(cls) -> int | None:
        """Guests this host can hold: a core each, bounded by memory (``inspect_guest_memory_mb`` a guest)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        try:
            memory_mb = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
        except (ValueError, OSError):
            return cores
        return max(1, min(cores * 2, memory_mb // limits.LIMITS.inspect_guest_memory_mb))

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        settings = load(config)
        session = _session(settings)
        # The baseline is prepared once here (pull/unpack/warm setup): a throwaway guest does it.
        vm = await session.acreate(f"{task_name}:init", **settings.guest_keywords())
        await session.adestroy(vm)

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        settings = load(config)
        session = _session(settings)
        keywords = settings.guest_keywords()
        user = keywords.get("user")  # the VM runs file operations as it too
        environments: dict[str, SandboxEnvironment] = {}
        try:
            for name in settings.environments:
                vm = await session.acreate(f"{task_name}:{name}", **keywords)
                sandbox = environments[name] = cls(vm, session, user)
                await sandbox._prepare_workdir()
        except BaseException:
            for made in environments.values():
                await session.adestroy(made.as_type(SmolvmSandboxEnvironment).vm)
            raise
        return environments

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        for environment in environments.values():
            sandbox = environment.as_type(SmolvmSandboxEnvironment)
            await sandbox._session.adestroy(sandbox.vm)

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                           cleanup: bool) -> None:
        session = _sessions.pop(load(config).model_dump_json(), None)
        if session is not None:
            # Destroys what samples left, then reaps this run's leftovers; with Inspect's
            # --no-sandbox-cleanup (no sample_cleanup ran) the samples' guests are kept instead.
            await session.aclose(keep=not cleanup)

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup smolvm [NAME]``: guests whose owner is gone, through the reaper.

        Kept guests too where they are a Session's (``--no-sandbox-cleanup`` keeps the samples'),
        or named; a pytest run's ``--smol-keep`` guests are left to ``pytest-smolvm reap --kept``.
        """
        from pytest_smolvm.handle.aio import in_thread
        from pytest_smolvm.host import registry
        from pytest_smolvm.session.library import WORKER
        from pytest_smolvm.session.reaper import destroy_record

        def select(record: registry.Record) -> bool:
            if id is not None and record.name != id:
                return False
            return registry.orphaned(record, include_kept=id is not None or record.worker == WORKER)

        await in_thread(lambda: registry.reap(select, destroy_record))

    async def _prepare_workdir(self) -> None:
        owner = "root" if self._user is None else str(self._user)
        result = await self.vm.aio.exec(["/bin/sh", "-c", f'mkdir -p {WORKDIR} && chown "$1" {WORKDIR}', "sh", owner],
                                        user="root")
        result.check()

    # ------------------------------------------------------------------ exec and files

    @override
    async def exec(self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        run_as = user if user is not None else self._user
        workdir = self._path(cwd) if cwd is not None else WORKDIR
        try:
            result = await self.vm.aio.exec(cmd, stdin=input, workdir=workdir, env=env or {}, timeout=timeout,
                                            user=run_as)
        except FileNotFoundError as exc:  # a missing program is the command's failure, not ours
            return ExecResult(False, 127, "", f"{exc}\n")
        except PermissionError:
            raise
        except Exception as exc:
            if run_as is not None and str(run_as) in str(exc):  # an unknown user: a failed result naming it
                return ExecResult(False, 126, "", f"{exc}\n")
            raise
        if result.timed_out:
            raise TimeoutError(f"command timed out after {timeout} seconds: {' '.join(cmd)}")
        if result.truncated:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                                           result.stdout if "stdout" in result.truncated else result.stderr)
        return ExecResult(result.exit_code == 0, result.exit_code, result.stdout, result.stderr)

    @override
    async def write_file(self, file: str, contents: str | bytes) -> None:
        path = self._path(file)
        data = contents.encode("utf-8") if isinstance(contents, str) else contents
        await self.vm.aio.write_file(path, data)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    @override
    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        path = self._path(file)
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        try:
            data = await self.vm.aio.read_file(path, max_bytes=limit)
        except OSError as exc:
            if exc.errno == errno.EFBIG:
                raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None) from None
            raise
        return data.decode("utf-8") if text else data

    def _path(self, file: str) -> str:
        return file if posixpath.isabs(file) else posixpath.join(WORKDIR, file)
