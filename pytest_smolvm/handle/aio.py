"""``smol_vm.aio``: the same guest as an async handle, for asyncio, anyio and trio code.

Each call runs the blocking call on a thread (host/threads.py's Workers: a kept one when one is idle, at
most Workers' bound at once),
so concurrent awaits run concurrently (the guest serves them at once) and the event loop never blocks. Cancelling
the awaiting task kills the guest command: the exec's :class:`~pytest_smolvm.backends.Cancel`
is fired, and the backend kills the command's process group in the guest.

``on_output`` callbacks run in the event loop's thread, in order, all before the await returns.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from pytest_smolvm.backends.base import Cancel, OutputCallback
from pytest_smolvm.handle.base import GuestHandle
from pytest_smolvm.handle.result import ExecResult
from pytest_smolvm.host.threads import Workers

T = TypeVar("T")
P = ParamSpec("P")
_THREADS = Workers("smol-vm-aio")  # kept, bounded threads; signals stay with the main thread


def _awaited(method: Callable[Concatenate[GuestHandle, P], T]) -> Callable[Concatenate[AsyncVM, P], Awaitable[T]]:
    """``method`` of the blocking handle as a coroutine method: same parameters, defaults and
    errors (the blocking one runs on a thread of its own)."""

    @functools.wraps(method)
    async def awaited(self: AsyncVM, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await _Loop().run(lambda: method(self.sync, *args, **kwargs))

    return awaited


def _awaited_exec(method: Callable[Concatenate[GuestHandle, P], ExecResult],
                  ) -> Callable[Concatenate[AsyncVM, P], Awaitable[ExecResult]]:
    """``exec`` as a coroutine method whose cancellation kills the guest command, and whose
    ``on_output`` callbacks run in the event loop's thread."""

    @functools.wraps(method)
    async def awaited(self: AsyncVM, /, *args: P.args, **kwargs: P.kwargs) -> ExecResult:
        cancel = Cancel()
        loop = _Loop()
        on_output: OutputCallback | None = kwargs.pop("on_output", None)  # type: ignore[assignment]
        callback = loop.wrap(on_output) if on_output is not None else None
        run: Callable[..., ExecResult] = self.sync._exec_cancellable
        return await loop.run(lambda: run(*args, on_output=callback, cancel=cancel, **kwargs), cancel)

    return awaited


class AsyncVM:
    """Async twin of :class:`~pytest_smolvm.handle.vm.VM`; get it as ``smol_vm.aio``."""

    def __init__(self, vm: GuestHandle) -> None:
        self.sync = vm  # the blocking handle, for what has no async twin (logs, transcript)

    @property
    def name(self) -> str:
        return self.sync.name

    @property
    def workdir(self) -> str:
        return self.sync.workdir

    def __repr__(self) -> str:
        return f"<AsyncVM {self.name}>"

    exec = _awaited_exec(GuestHandle.exec)
    read_file = _awaited(GuestHandle.read_file)
    write_file = _awaited(GuestHandle.write_file)
    copy_in = _awaited(GuestHandle.copy_in)
    copy_out = _awaited(GuestHandle.copy_out)
    reward = _awaited(GuestHandle.reward)  # cancelling the await leaves the branch to finish, then go

    async def branch(self) -> AsyncVM:
        """``vm.branch()`` awaited: the child as an async handle (its blocking one is ``.sync``)."""
        return AsyncVM(await _Loop().run(self.sync.branch))

    async def branch_batch(self, n: int) -> list[AsyncVM]:
        """``vm.branch_batch(n)`` awaited: the children as async handles, all or none."""
        return [AsyncVM(child) for child in await _Loop().run(lambda: self.sync.branch_batch(n))]


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

        def target() -> Callable[[], None]:
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting task, once this thread is idle again
                error = exc
                return lambda: self.call_soon(settle, None, error)
            return lambda: self.call_soon(settle, result, None)

        _THREADS.submit(target)
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
