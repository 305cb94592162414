"""urllib's proxy lookup, safe against pytest changing the environment on another thread.

The SDK asks ``urllib.request.getproxies()`` before every cloud request (``transport.py``,
``_CloudPool.can_pool``), and that reads the environment key by key: it lists the keys, then
looks each one up. pytest sets ``PYTEST_CURRENT_TEST`` at each phase of a test and removes it
after the test's teardown (pytest-dev/pytest#10876), so a lookup on one of this plugin's threads
(a guest being made ahead, destroyed in the background, or an ``aio`` call) can list the key and
then not find it: a ``KeyError`` (or a ``RuntimeError``) out of an SDK call that never reached
the network. At 1,000 concurrent episodes that was one failed call in every few thousand. The
lookup only reads, so reading again is the whole fix; the race window is microseconds wide.
"""

from __future__ import annotations

import functools
import threading
import urllib.request
from collections.abc import Callable

ATTEMPTS = 5
_lock = threading.Lock()
_installed: list[Callable[[], dict[str, str]]] = []  # the guarded lookup, once installed


def install() -> None:
    """Make ``urllib.request.getproxies`` read again when the environment changed under it."""
    with _lock:
        if _installed and urllib.request.getproxies is _installed[0]:
            return
        original = urllib.request.getproxies

        @functools.wraps(original)
        def getproxies() -> dict[str, str]:
            for _ in range(ATTEMPTS - 1):
                try:
                    return original()
                except (KeyError, RuntimeError):  # a key removed (or added) while it was read
                    continue
            return original()

        _installed[:] = [getproxies]
        setattr(urllib.request, "getproxies", getproxies)  # noqa: B010 (a module's attribute, on purpose)
