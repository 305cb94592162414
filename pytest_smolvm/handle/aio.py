"""``smol_vm.aio``: the same guest as an async handle, for asyncio, anyio and trio code.

Each call runs the blocking call in a thread of its own, so concurrent awaits run
concurrently (the guest serves them at once) and the event loop never blocks. Cancelling
the awaiting task kills the guest command: the exec's :class:`~pytest_smolvm.backends.Cancel`
is fired, and the backend kills the command's process group in the guest.

``on_output`` callbacks run in the event loop's thread, in order, all before the await returns.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pytest_smolvm.backends.base import Cancel, OutputCallback
from pytest_smolvm.handle.vm import DEFAULT, DEFAULT_READ_LIMIT, ExecResult, Timeout

if TYPE_CHECKING:
    from pytest_smolvm.handle.vm import VM

T = TypeVar("T")


class AsyncVM:
    """Async twin of :class:`~pytest_smolvm.handle.vm.VM`; get it as ``smol_vm.aio``."""

    def __init__(self, vm: VM) -> None:
        self.sync = vm  # the blocking handle, for what has no async twin (logs, transcript)

    @property
    def name(self) -> str:
        return self.sync.name

    @property
    def workdir(self) -> str:
        return self.sync.workdir

    def __repr__(self) -> str:
        return f"<AsyncVM {self.name}>"

    async def exec(self, cmd: str | Sequence[str], *, timeout: Timeout = DEFAULT,
                   env: Mapping[str, str] | None = None, workdir: str | None = None,
                   stdin: str | bytes | None = None, user: str | int | None = None, check: bool = False,
                   on_output: OutputCallback | None = None) -> ExecResult:
        """:meth:`VM.exec <pytest_smolvm.handle.vm.VM.exec>`, awaited; cancelling the task kills the command."""
        cancel = Cancel()
        loop = _Loop()
        callback = loop.wrap(on_output) if on_output is not None else None

        def call() -> ExecResult:
            return self.sync._exec(cmd, timeout=timeout, env=env, workdir=workdir, stdin=stdin, user=user,
                                   check=check, on_output=callback, cancel=cancel)

        return await loop.run(call, cancel)

    async def read_file(self, path: str, *, max_bytes: int = DEFAULT_READ_LIMIT) -> bytes:
        return await _Loop().run(lambda: self.sync.read_file(path, max_bytes=max_bytes))

    async def write_file(self, path: str, data: str | bytes, *, mode: int | None = None) -> None:
        await _Loop().run(lambda: self.sync.write_file(path, data, mode=mode))

    async def copy_in(self, src: str | os.PathLike[str], dest: str) -> None:
        await _Loop().run(lambda: self.sync.copy_in(src, dest))

    async def copy_out(self, src: str, dest: str | os.PathLike[str], *, max_bytes: int | None = None,
                       timeout: float | None = None) -> Path:
        return await _Loop().run(lambda: self.sync.copy_out(src, dest, max_bytes=max_bytes, timeout=timeout))


async def in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own, awaited from the running asyncio or trio loop."""
    return await _Loop().run(fn)


class _Loop:
    """The running event loop, asyncio's or trio's (anyio runs on one of the two)."""

    def __init__(self) -> None:
        try:
            self.asyncio: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.asyncio = None
        self.trio_token: Any = None
        if self.asyncio is None:
            trio = sys.modules.get("trio")
            try:
                self.trio_token = trio.lowlevel.current_trio_token() if trio is not None else None
            except RuntimeError:
                self.trio_token = None
            if self.trio_token is None:
                raise RuntimeError("smol_vm.aio needs a running asyncio or trio event loop "
                                   "(use the smol_vm handle itself from synchronous code)")

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` in the loop's thread, soon; dropped if the loop has closed."""
        try:
            if self.asyncio is not None:
                self.asyncio.call_soon_threadsafe(fn, *args)
            else:
                self.trio_token.run_sync_soon(fn, *args)
        except RuntimeError:
            pass  # the loop is gone: nobody is waiting any more

    def wrap(self, on_output: OutputCallback) -> OutputCallback:
        def in_loop(stream: str, data: bytes) -> None:
            self.call_soon(on_output, stream, data)
        return in_loop

    async def run(self, fn: Callable[[], T], cancel: Cancel | None = None) -> T:
        if self.asyncio is None:
            return await self._run_trio(fn, cancel)
        future: asyncio.Future[T] = self.asyncio.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if future.cancelled():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def target() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting task
                self.call_soon(settle, None, exc)
            else:
                self.call_soon(settle, result, None)

        threading.Thread(target=target, name="smol-vm-aio", daemon=True).start()
        try:
            return await future
        except asyncio.CancelledError:
            if cancel is not None:
                cancel.cancel()
            raise

    async def _run_trio(self, fn: Callable[[], T], cancel: Cancel | None) -> T:
        trio: Any = sys.modules["trio"]  # present: _Loop found trio's token
        if _release(trio.__version__) < TRIO_NEEDED:
            raise RuntimeError(f"smol_vm.aio under trio needs trio>={'.'.join(map(str, TRIO_NEEDED))}, "
                               f"and trio {trio.__version__} is installed: pip install -U trio")
        try:
            # abandon_on_cancel arrived in trio 0.23 and replaced cancellable=, which 0.35 removed.
            result: T = await trio.to_thread.run_sync(fn, abandon_on_cancel=True)
        except trio.Cancelled:
            if cancel is not None:
                cancel.cancel()
            raise
        # Output callbacks were queued before the thread returned; let them run first.
        await trio.lowlevel.checkpoint()
        return result


TRIO_NEEDED = (0, 23)  # trio.to_thread.run_sync(abandon_on_cancel=...)


def _release(version: str) -> tuple[int, ...]:
    """``"0.23.1+dev"`` -> ``(0, 23, 1)``: enough of PEP 440 to compare trio's releases."""
    parts = []
    for piece in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)
