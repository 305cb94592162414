"""Exceptions users see. Each one says what went wrong in one line."""

from __future__ import annotations

import errno

from pytest_smolvm.inert import inert


class SmolVMError(Exception):
    """Base class of every pytest-smolvm error.

    Its message is made inert here, once for every error: many quote a guest (a command's
    stderr, a member's name, an engine's error), and each reaches a terminal, JUnit and HTML.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*(inert(arg) if isinstance(arg, str) else arg for arg in args))


class UsageError(SmolVMError):
    """A bad option, ini value or marker argument. Its message names the option."""


class MarkerError(UsageError):
    """A bad ``smol`` marker or factory keyword: that one test errors, the run goes on."""


class ClosedError(UsageError):
    """A guest asked of a Session (or a pool) that is closed or closing: nothing was made; or a
    call on a handle whose guest its owner has destroyed."""


class ProvisionError(SmolVMError):
    """The backend could not make a guest: infrastructure, not the test's fault."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable  # worth another try: the engine said so, or a helper died


class GuestError(SmolVMError):
    """A guest operation (file transfer, exec plumbing) failed."""


class GuestFileNotFoundError(GuestError, FileNotFoundError):
    """A guest path that a file operation needs is not there; ``.filename`` is that guest path.

    A ``FileNotFoundError`` too (``errno.ENOENT``), so code that handles the guest's refusals as
    the host's own keeps working; its message names the operation and says the path is the guest's.
    """

    def __init__(self, operation: str, guest_path: str) -> None:
        super().__init__(errno.ENOENT, f"{operation}: no such file or directory in the guest: {guest_path}",
                         guest_path)
        self.operation = operation

    def __reduce__(self) -> tuple[type[GuestFileNotFoundError], tuple[str, str]]:
        return type(self), (self.operation, str(self.filename))  # OSError's own would pass errno first

    def __str__(self) -> str:
        return str(self.strerror)


class GuestUserError(SmolVMError, LookupError):
    """The user an exec or file operation asked for is unknown in the guest (or unusable)."""


class ExecError(SmolVMError):
    """A command in the guest failed and ``check=True`` was asked for."""

    def __init__(self, message: str, result: object) -> None:
        super().__init__(message)
        self.result = result


class RegistryError(UsageError):
    """Pulling an image failed: the message names the image and what to do."""


class BaselineSetupError(ProvisionError):
    """The warm baseline's setup failed; every test that needs it fails with this, once."""


class ResultsError(SmolVMError, ValueError):
    """A results file that cannot be read: the message names the file and line."""


class TarFormatError(GuestError):
    """The stream is not a tar archive this parser reads (truncated, malformed, an unknown type)."""


class UnsafeArchive(GuestError):
    """A guest-made (or image) archive broke a rule; the message names the member."""


class DigestMismatch(Exception):
    """The bytes read do not hash to the digest they were asked for."""


class SmolVMWarning(UserWarning):
    """Something a test's outcome does not show: a guest that could not be destroyed (its registry
    record stays for the reaper), an exec output cut at the output limit."""
