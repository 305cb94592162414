"""Start ``python -m tests.smolcloud`` as a real subprocess for tests, and read its admin view."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


class LoopbackCloud:
    """One server process on 127.0.0.1; ``env()`` is what points the SDK at it."""

    def __init__(self, *args: str, state_dir: Path | None = None, token: str = "pytest-smolvm-tests",
                 attach: str | None = None) -> None:
        self.token = token
        self.state_dir = state_dir
        self.proc: subprocess.Popen[bytes] | None = None
        if attach is not None:  # a server someone else started (and stops)
            self.url = attach
            return
        argv = [sys.executable, "-m", "tests.smolcloud", "--exit-with-parent", *args]
        if state_dir is not None:
            argv += ["--state-dir", str(state_dir)]
        env = {k: v for k, v in os.environ.items() if k not in ("SMOL_CLOUD_URL", "SMOL_CLOUD_TOKEN")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.url = self._read_url()

    def _read_url(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT)
        line = self.proc.stdout.readline().decode().strip() if ready else ""
        if not line.startswith("SMOL_CLOUD_URL=http://127.0.0.1:"):
            self.proc.kill()
            _out, err = self.proc.communicate(timeout=STOP_TIMEOUT)
            raise RuntimeError(f"smolcloud did not start (first line {line!r}): {err.decode(errors='replace')}")
        return line.partition("=")[2]

    def env(self, token: str | None = None) -> dict[str, str]:
        return {"SMOL_CLOUD_URL": self.url, "SMOL_CLOUD_TOKEN": token or self.token}

    def admin(self, what: str = "machines") -> Any:
        with urllib.request.urlopen(f"{self.url}/_smolcloud/{what}", timeout=30) as resp:
            return json.loads(resp.read())

    def history(self, token: str | None = None) -> list[dict[str, Any]]:
        """Every create and branch the server accepted (for ``token`` only, if given)."""
        found: list[dict[str, Any]] = self.admin("history")["history"]
        return [h for h in found if token is None or h["owner"] == token]

    def calls(self, token: str) -> dict[str, int]:
        """The API calls ``token`` made, as the SDK sent them: ``{"POST /v1/machines/{id}/branches": n}``."""
        found: dict[str, int] = self.admin(f"calls?owner={urllib.parse.quote(token)}")["calls"]
        return found

    def machines(self) -> list[dict[str, Any]]:
        """Every machine the server holds, whatever token made it."""
        found: list[dict[str, Any]] = self.admin("machines")["machines"]
        return found

    def wait_for_no_machines(self, timeout: float = 10.0, token: str | None = None,
                             labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """What is still there after ``timeout`` (only ``token``'s, with ``labels``, if given)."""
        deadline = time.monotonic() + timeout
        while True:
            left = [m for m in self.machines() if (token is None or m["owner"] == token)
                    and all(m["labels"].get(k) == v for k, v in (labels or {}).items())]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def stop(self) -> tuple[int, str]:
        """SIGTERM, as a CI runner would; returns (exit status, stderr)."""
        if self.proc is None:
            return 0, ""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            _out, err = self.proc.communicate(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            _out, err = self.proc.communicate()
        return self.proc.returncode, err.decode(errors="replace")
