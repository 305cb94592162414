"""The backend's bare loop, no pytest: ``python _bare.py N`` runs N x (create, exec "true", destroy).

The caller times the whole process for N and 2N and divides the difference by N, exactly as it
does for a pytest run of N and 2N tests: interpreter start-up and the first guest (which
starts the zygote) cancel out, and what is left is the steady per-guest cost.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pytest_smolvm.backends import VMSpec
from pytest_smolvm.backends.namespace import NamespaceBackend
from pytest_smolvm.baseline import resolve

ARGV = ["/bin/sh", "-c", "true"]  # what smol_vm.exec("true") sends


def main() -> None:
    count = int(sys.argv[1])
    backend = NamespaceBackend()
    baseline = resolve(None, Path.cwd())
    backend.prepare_run(baseline)
    try:
        for i in range(count):
            guest = backend.create(VMSpec(name=f"bare-{i}", baseline=baseline))
            try:
                result = guest.exec(ARGV, env={}, workdir=None, stdin=None, timeout=None, output_limit=1 << 20)
                assert result.exit_code == 0, result
            finally:
                guest.destroy()
    finally:
        backend.close()


if __name__ == "__main__":
    main()
