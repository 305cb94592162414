"""What execve accepts of a command's argv and env, checked by each backend before it sends one."""

from __future__ import annotations

import errno
from collections.abc import Sequence

# Linux never lets argv+env exceed 3/4 of _STK_LIM (6 MiB), whatever the stack rlimit:
# bigger requests are refused before any byte is copied.
ARG_HARD_LIMIT = 6 << 20
MAX_ARG_STRLEN = 32 * 4096  # the kernel's limit on one argument or env entry


def argv_size(argv: Sequence[str], env: dict[str, str]) -> int:
    """Bytes execve copies for argv and env (strings with their NULs, plus the pointers)."""
    strings = sum(len(a.encode()) + 1 for a in argv) + sum(len(f"{k}={v}".encode()) + 1 for k, v in env.items())
    return strings + 8 * (len(argv) + len(env) + 2)


def too_big(size: int, arg_max: int, program: str) -> OSError:
    return OSError(errno.E2BIG, f"Argument list too long: argv and env take {size} bytes; the guest "
                                f"allows ARG_MAX={arg_max} bytes in all and {MAX_ARG_STRLEN} bytes "
                                "per argument or env entry", program)
