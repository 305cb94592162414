"""The namespace backend's guest helper (``_nsguest.py``), loaded as the backend loads it."""

from __future__ import annotations

import subprocess
import sys

from pytest_smolvm.backends.namespace import GUEST_HELPER, HELPER_ENV

# Load the helper's source from stdin, as namespace.Zygote does, then stop before its main
# block and say which of the modules that register at-fork hooks it has imported.
LOAD_AND_REPORT = (
    "import sys; src = sys.stdin.buffer.read().replace(b'if __name__ == \"__main__\":', b'if False:'); "
    "exec(compile(src, '_nsguest.py', 'exec')); _preload(); "
    "print(sorted(m for m in ('threading', 'random', 'multiprocessing', 'concurrent.futures') if m in sys.modules))"
)


def test_the_helper_imports_nothing_that_runs_python_at_every_fork() -> None:
    """Each guest is a fork of the helper, and each fork runs every at-fork hook registered in
    it: threading's and random's cost ~0.6 ms a guest on a paravirtualized host. The helper
    once pulled them in through ctypes.util and subprocess."""
    source = GUEST_HELPER.read_bytes()
    assert b'if __name__ == "__main__":' in source
    result = subprocess.run([sys.executable, "-I", "-S", "-c", LOAD_AND_REPORT], input=source,
                            capture_output=True, env=HELPER_ENV, timeout=60, check=True)
    assert result.stdout.decode().strip() == "[]", result.stderr.decode()
