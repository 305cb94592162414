"""Can this host really boot a microVM? Answered by booting one, never by asking.

``smol.local_availability()`` tests ``/dev/kvm`` as the calling user, but the VMM drops to a
per-VM uid before it opens ``/dev/kvm``, and on a PVM host ``/dev/kvm`` opens fine yet no
ordinary guest kernel boots. Only a real boot tells the truth. The boot runs in a child
process in its own process group with a hard wall-clock limit: the engine's own readiness
waits are minutes long, and a stalled boot must not stall a pytest session.

The probe boots what tests use: a branchable source and one branch of it (the smol backend
forks every test's guest that way), so a host where a plain boot works but branching does not
is not taken for a working one.

An answer is cached per host, boot, user, smolmachines version and ``/dev/kvm`` identity,
because none of those change within a boot unless someone fixes the host (which changes the
``/dev/kvm`` mode or group and so the key): a run on a host where no microVM boots would
otherwise pay a probe boot (seconds; more on the engine's first use) every so often, inside the duration
of whichever test came first. A user who fixes the host by other means (a module, a group
membership) runs ``pytest-smolvm doctor``, which re-probes and replaces the cached answer. Only
a timed-out boot is trusted for minutes: it can be the engine's slow first start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from pytest_smolvm import limits
from pytest_smolvm.backends.base import ProbeResult
from pytest_smolvm.backends.smol.boot_failures import TIMEOUT_REASON
from pytest_smolvm.backends.smol.sdk import remove_fork_lock, vm_data_dir
from pytest_smolvm.host.paths import cache_dir
from pytest_smolvm.host.procs import process_start_time

TIMEOUT_ENV = "PYTEST_SMOLVM_PROBE_TIMEOUT"
CACHE_FILE = "probe.json"
# A timed-out boot can be a slow first run while the engine unpacks its 36 MB guest rootfs: it
# is trusted for minutes. Any other answer holds while the cache key does (module docstring).
TIMEOUT_TTL = 600.0
PROBE_NAME_PREFIX = "pytest-smolvm-probe-"
# What changes how a guest boots, so a cached answer is only reused when these are unchanged.
# Not SMOLVM_SECCOMP/SMOLVM_LANDLOCK: importing smol sets them itself (transport.py:313-314), so
# they differ between a process that imported it and one that did not, for the same host.
BOOT_ENV_KNOBS = ("SMOLVM_VM_UID_DROP", "SMOLVM_LIB_DIR", "SMOLVM_BOOT_BINARY", "SMOLVM_AGENT_ROOTFS",
                  "SMOLVM_AGENT_ROOTFS_TAR", "XDG_CACHE_HOME", "XDG_DATA_HOME")
DELETE_TIMEOUT = 30.0


@dataclass(frozen=True)
class BootReport:
    """One uncached probe boot: the verdict plus what ``doctor`` shows."""

    available: bool
    reason: str
    elapsed: float
    timed_out: bool = False
    code: str = ""

    def result(self) -> ProbeResult:
        return ProbeResult(self.available, self.reason)


def probe_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        if value > 0:
            return value
    return limits.LIMITS.smol_probe_boot


def smolmachines_version() -> str | None:
    try:
        return version("smolmachines")
    except PackageNotFoundError:
        return None


def precheck() -> ProbeResult | None:
    """A reason not to try a boot at all, found without booting (or importing smol)."""
    if find_spec("smol") is None:
        return ProbeResult(False, "smolmachines is not installed (pip install smolmachines)")
    if sys.platform.startswith("linux"):
        if not os.path.exists("/dev/kvm"):
            return ProbeResult(False, "/dev/kvm does not exist: KVM is not enabled on this host "
                                      "(no hardware virtualisation, or no nested virtualisation in this VM)")
    elif sys.platform != "darwin":
        return ProbeResult(False, f"smolmachines has no local engine for {sys.platform}")
    return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def _kvm_identity() -> str:
    try:
        st = os.stat("/dev/kvm")
    except OSError:
        return "no-kvm"
    return f"{st.st_mode:o}:{st.st_uid}:{st.st_gid}:{st.st_rdev}"


def cache_key() -> str:
    knobs = ",".join(f"{k}={os.environ.get(k, '')}" for k in BOOT_ENV_KNOBS)
    raw = (f"{socket.gethostname()}|{_boot_id()}|uid={os.geteuid()}|smol={smolmachines_version()}"
           f"|kvm={_kvm_identity()}|{knobs}")
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _load_cached(key: str) -> ProbeResult | None:
    try:
        data = json.loads(_cache_path().read_text())
        entry = data.get(key) if isinstance(data, dict) else None
        if not isinstance(entry, dict):
            return None
        expires = entry.get("expires")
        if expires is not None and time.time() > float(expires):
            return None
        return ProbeResult(bool(entry["available"]), str(entry["reason"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(key: str, report: BootReport) -> None:
    path = _cache_path()
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    now = time.time()
    # Entries for other boots are dead weight: keep only those still possibly valid.
    data = {k: v for k, v in data.items() if isinstance(v, dict) and v.get("boot_id") == _boot_id()}
    data[key] = {"available": report.available, "reason": report.reason, "elapsed": round(report.elapsed, 3),
                 "at": now, "boot_id": _boot_id(), "host": socket.gethostname(),
                 "expires": now + TIMEOUT_TTL if report.timed_out else None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CACHE_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # the cache only saves time


def probe(*, use_cache: bool = True, timeout: float | None = None) -> ProbeResult:
    """Whether a microVM boots here, and the exact reason when it does not."""
    early = precheck()
    if early is not None:
        return early
    if not use_cache:
        return boot(timeout).result()
    key = cache_key()
    cached = _load_cached(key)
    if cached is not None:
        return cached
    from filelock import FileLock, Timeout

    limit = timeout or probe_timeout()
    lock_path = cache_dir() / "probe.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        # One boot per host at a time: xdist workers that ask together share one answer.
        with FileLock(str(lock_path), timeout=limit + DELETE_TIMEOUT + 10):
            cached = _load_cached(key)
            if cached is not None:
                return cached
            report = boot(limit)
            _store(key, report)
            return report.result()
    except Timeout:
        return ProbeResult(False, f"another process held the probe lock {lock_path} "
                                  "for longer than a probe takes")


def remember(report: BootReport) -> None:
    """Cache a boot made elsewhere (``pytest-smolvm doctor`` always boots afresh)."""
    if precheck() is None:
        _store(cache_key(), report)


def _child_env() -> dict[str, str]:
    """This environment plus the path that makes this package importable in the child."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[3])  # the package's own root
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def boot(timeout: float | None = None) -> BootReport:
    """Boot a bare microVM in a child process, uncached; never takes longer than ``timeout`` + cleanup."""
    early = precheck()
    if early is not None:
        return BootReport(False, early.reason, 0.0)
    limit = timeout or probe_timeout()
    name = f"{PROBE_NAME_PREFIX}{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest_smolvm.backends.smol.probe", "--boot", name, str(limit)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=_child_env(), start_new_session=True)
    try:
        return _wait_for_verdict(proc, name, limit, started)
    finally:
        remove_fork_lock(name)
        remove_fork_lock(f"{name}-b")


def _wait_for_verdict(proc: subprocess.Popen[bytes], name: str, limit: float, started: float) -> BootReport:
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        elapsed = time.monotonic() - started
        detail = _last_boot_message(name)
        _delete_by_name(f"{name}-b")
        _delete_by_name(name)
        reason = f"{TIMEOUT_REASON} {limit:g}s"
        if detail:
            reason += f" (last VMM message: {detail})"
        return BootReport(False, reason, elapsed, timed_out=True, code="TIMEOUT")
    elapsed = time.monotonic() - started
    for line in reversed(stdout.decode(errors="replace").splitlines()):
        try:
            verdict: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        if verdict.get("ok"):
            return BootReport(True, f"a branchable microVM booted and a branch of it ran /bin/sh "
                                    f"in {elapsed:.2f}s", elapsed)
        code = str(verdict.get("code") or "ERROR")
        return BootReport(False, f"[{code}] {verdict.get('message', '')}".strip(), elapsed, code=code)
    tail = stderr.decode(errors="replace").strip().splitlines()
    _delete_by_name(f"{name}-b")
    _delete_by_name(name)
    return BootReport(False, f"the probe process exited {proc.returncode} without a verdict"
                             + (f": {tail[-1]}" if tail else ""), elapsed)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _last_boot_message(name: str) -> str:
    for log in ("agent-startup-error.log", "agent-console.log"):
        try:
            lines = (vm_data_dir(name) / log).read_text(errors="replace").strip().splitlines()
        except OSError:
            continue
        if lines:
            return whole(lines[-1])
    return ""


def whole(text: str, limit: int = 400) -> str:
    """``text``, or its start cut at a sentence's (else a word's) end and marked: never mid-word."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = head.rfind(". ")
    cut = head[:end + 1] if end >= limit // 2 else head.rsplit(" ", 1)[0]
    return f"{cut} [{len(text) - len(cut)} more characters]"


def _delete_by_name(name: str) -> None:
    """Delete a half-made probe machine, in a child so this process never imports smol."""
    # On a timeout the reaper's label sweep is the backstop: the probe must stay bounded.
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-m", "pytest_smolvm.backends.smol.probe", "--delete", name],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=_child_env(), timeout=DELETE_TIMEOUT, start_new_session=True, check=False)


# --------------------------------------------------------------------------- the child side


def _child_boot(name: str, timeout: float) -> dict[str, Any]:
    import smol
    from smol import ConnectOptions, Machine, MachineConfig, ResourceSpec, SmolError

    available, code, reason = smol.local_availability()
    if not available:
        return {"ok": False, "code": code or "UNAVAILABLE", "message": reason or "local engine unavailable"}
    local = ConnectOptions(target="local")
    labels = {"pytest-smolvm": "1", "role": "probe", "owner_pid": str(os.getpid()),
              "owner_start": str(process_start_time(os.getpid()))}
    # The shape tests use: a persistent branchable source, and a branch of it that runs a command.
    config = MachineConfig(name=name, resources=ResourceSpec(cpus=1, memory_mb=512, network=False),
                           labels=labels, branchable=True, persistent=True, ready_timeout_seconds=timeout)
    try:
        source = Machine.create(config, local)
    except SmolError as exc:
        return {"ok": False, "code": exc.code, "message": exc.message}
    branch_name = f"{name}-b"
    try:
        try:
            branch = source.branch(branch_name)
        except SmolError as exc:
            return {"ok": False, "code": exc.code, "message": f"the source booted, but branching it failed: "
                                                             f"{exc.message}"}
        try:
            result = branch.exec(["/bin/sh", "-c", "true"])
            if result.exit_code != 0:
                return {"ok": False, "code": "EXEC_FAILED", "message": f"/bin/sh -c true exited "
                        f"{result.exit_code} in a branch: {result.stderr[-300:]}"}
            return {"ok": True}
        except SmolError as exc:
            return {"ok": False, "code": exc.code, "message": f"branched, but exec failed: {exc.message}"}
        finally:
            Machine.delete_by_name(branch_name, local)  # children before their source
    finally:
        try:
            source.delete()
        except SmolError:
            Machine.delete_by_name(name, local)


def _child_main(argv: list[str]) -> int:
    if argv[:1] == ["--boot"] and len(argv) == 3:
        try:
            verdict = _child_boot(argv[1], float(argv[2]))
        except Exception as exc:  # the parent needs a verdict, whatever went wrong
            verdict = {"ok": False, "code": type(exc).__name__, "message": str(exc)}
        print(json.dumps(verdict), flush=True)
        return 0
    if argv[:1] == ["--delete"] and len(argv) == 2:
        from smol import ConnectOptions, Machine

        Machine.delete_by_name(argv[1], ConnectOptions(target="local"))
        return 0
    result = probe(use_cache="--no-cache" not in argv)
    print(("available: " if result.available else "unavailable: ") + result.reason)
    return 0 if result.available else 1


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
