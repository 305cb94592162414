"""The namespace backend's guest helper (``backends/namespace/helper/``), loaded as the backend loads it."""

from __future__ import annotations

import subprocess
import sys

from pytest_smolvm.backends.namespace.zygote import HELPER_ENV, helper_code

# Load the helper's modules from stdin, as namespace.Zygote does, but without running the
# zygote's main(); then say which of the modules that register
# at-fork hooks it has imported.
LOAD_AND_REPORT = (
    "import sys, marshal, types\n"
    "for n, c in marshal.loads(sys.stdin.buffer.read()):\n"
    "    m = types.ModuleType(n); sys.modules[n] = m; exec(c, m.__dict__)\n"
    "m._preload()\n"
    "print(sorted(m for m in ('threading', 'random', 'multiprocessing', 'concurrent.futures') if m in sys.modules))"
)


def test_the_helper_imports_nothing_that_runs_python_at_every_fork() -> None:
    """Each guest is a fork of the helper, and each fork runs every at-fork hook registered in
    it: threading's and random's cost ~0.6 ms a guest on a paravirtualized host. The helper
    once pulled them in through ctypes.util and subprocess."""
    result = subprocess.run([sys.executable, "-I", "-S", "-c", LOAD_AND_REPORT], input=helper_code(),
                            capture_output=True, env=HELPER_ENV, timeout=60, check=True)
    assert result.stdout.decode().strip() == "[]", result.stderr.decode()
