"""The backend's bare loop, no pytest: ``python _bare.py N OUT`` runs N x (create, exec "true", destroy).

It writes to OUT the seconds per guest from the end of the first to the end of the last,
exactly as the pytest suite's conftest times a run of N tests: interpreter start-up, the
first guest (which starts the zygote) and the close are left out of both.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.baselines.baseline import resolve

ARGV = ["/bin/sh", "-c", "true"]  # what smol_vm.exec("true") sends


def main() -> None:
    count = int(sys.argv[1])
    backend = NamespaceBackend()
    baseline = resolve(None, Path.cwd())
    backend.prepare_run(baseline)
    first_done = 0.0
    try:
        for i in range(count):
            guest = backend.create(VMSpec(name=f"bare-{i}", baseline=baseline))
            try:
                result = guest.exec(ARGV, env={}, workdir=None, stdin=None, timeout=None, output_limit=1 << 20)
                assert result.exit_code == 0, result
            finally:
                guest.destroy()
            if i == 0:
                first_done = time.perf_counter()
        last_done = time.perf_counter()
    finally:
        backend.close()
    Path(sys.argv[2]).write_text(json.dumps((last_done - first_done) / (count - 1)))


if __name__ == "__main__":
    main()
