"""Every default limit and timeout, with its meaning, in one place: :data:`LIMITS`.

Defaults apply alike on every backend, so a test behaves the same on a laptop's microVM, on
smol cloud and on a CI host's namespace guests. Code reads ``LIMITS.<field>`` when it
needs the value, never at import (no default argument, class attribute or constant is bound
to one: tests/test_spec.py checks); a guest's own (cpus, memory, disk, output) are read into
its spec when it is made (session/spec.py). So a ``conftest.py`` may lower one for a suite::

    import dataclasses
    from pytest_smolvm import limits
    limits.LIMITS = dataclasses.replace(limits.LIMITS, artifacts_bytes=8 << 20)

Format bounds that are not choices (a tar name's length, a message's size on a socket) stay
beside the code that parses them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    # ---- what a guest gets, when its marker names nothing
    # A guest's memory on every backend (``memory_mb`` overrides it everywhere). 4 GiB let one
    # namespace guest take most of a small CI host, and a test that passed there could OOM in a
    # 512 MiB microVM; 2 GiB fits a Python toolchain and an agent's build. It is what the guest's
    # processes get, as a microVM's RAM. A namespace guest has an ext4 disk of its own (its page
    # cache reclaimable: the limit is that alone); where it cannot (user-namespace mode), a tmpfs
    # disk, charged to its cgroup, whose limit adds the disk's size (backends/namespace/disk.py,
    # ``cgroups.create``).
    memory_mb: int = 2048
    # A guest's CPUs on every backend (``cpus`` overrides it everywhere): a microVM's vCPUs, a
    # namespace guest's cgroup quota. Two, as the common CI runner and sandbox have. The host's
    # cores less one, the namespace default before, gave the same test one CPU on a 2-core
    # runner and fifteen on a workstation.
    cpus: int = 2
    disk_mb: int = 2048  # a namespace guest's disk (tmpfs or ext4); filling it is ENOSPC, not a kill for memory

    # ---- what comes back from a guest
    output_bytes: int = 16 << 20  # kept per exec stream (``output_limit``); the rest is cut, ``truncated`` says so
    read_bytes: int = 64 << 20  # ``read_file``'s cap unless ``max_bytes`` says otherwise
    copy_out_bytes: int = 4 << 30  # what one ``copy_out`` may write to the host
    copy_out_members: int = 1_000_000  # files, dirs and links in one copied tree
    copy_out_timeout: float = 900.0  # seconds for one whole stream from the guest
    # Link components looked at while judging one copy's symlinks, all links together: each
    # link is resolved once (untrusted/linkmap.py), so this bounds the total length of their
    # targets; 4M steps take the host ~2 s.
    copy_out_link_steps: int = 4_000_000

    # ---- what reaches a report (a terminal, JUnit, HTML: not an archive)
    report_section_chars: int = 32_000  # characters per guest in a test's report section
    report_file_chars: int = 8 << 20  # characters per transcript or log file kept beside a report
    artifacts_bytes: int = 64 << 20  # bytes of collected guest files per test, all guests together
    result_param_chars: int = 2048  # a parametrize value's JSON in a result line; a longer one is referenced by sha256

    # ---- how long the host waits
    # The longest wait poll(2) and Python's timers take (2**31 - 1 ms, about 24.8 days): a longer
    # timeout would overflow them after the command had started in the guest.
    max_timeout: float = 2_147_483.0
    destroy_all_attempts: float = 60.0  # one guest's destroy, retries included; then the reaper takes over
    destroy_one_namespace_guest: float = 10.0  # a namespace guest's init to exit once killed
    # At session end, for creates cut off by Ctrl-C or a test timeout and destroys still under
    # way, all together (signals held meanwhile); what is left then is the reaper's.
    close_wait: float = 120.0
    exec_output_drain: float = 1.0  # after a command exits, reading what it left in its pipes
    plan_service_read: float = 10.0  # a worker's request to the controller, whole, from connect
    plan_service_connections: int = 16  # requests the controller serves at once (more wait their turn)
    guest_file_op: float = 900.0  # one file operation in a namespace guest (a FIFO, a stalled helper)
    guest_stage_discard: float = 60.0  # removing what a failed copy_in had staged in a namespace guest
    # A namespace guest's init, to take a request, or to report a request's end once the host has
    # killed it (a timeout, a cancel); an init that does neither is wedged: the host kills the guest.
    guest_answer_grace: float = 5.0
    smol_plumbing: float = 600.0  # mkdir/tar/rm for a smol file transfer: big trees, but never a hang
    smol_exec_cancel_grace: float = 30.0  # past a command's timeout, before the host kills the call
    smol_ready: float = 120.0  # a smol machine's agent to answer after start
    # One smol cloud call that starts or branches a machine, to answer: the SDK's own timeout
    # there is 30 minutes (it waits out the control plane's queue), a hang this long is an error.
    smol_call: float = 120.0
    smol_probe_boot: float = 20.0  # the probe's test boot ($PYTEST_SMOLVM_PROBE_TIMEOUT overrides it)
    registry_idle: float = 60.0  # without a byte from a registry before a request is given up
    credential_helper: float = 30.0  # a docker credential helper (one waiting on a desktop prompt)
    network_ready: float = 10.0  # pasta to bring a namespace guest's network up
    unpacker_grace: float = 30.0  # past a stream's own deadline, before the confined unpacker is killed

    # ---- what the Inspect provider budgets per guest when its config says nothing
    inspect_guest_memory_mb: int = 256


LIMITS = Limits()


def guest_timeout(label: str, value: object, error: type[Exception] = ValueError) -> float | None:
    """A guest timeout in seconds as ``label`` was given it; infinity means no limit (None).

    Anything else that is not a positive number of seconds up to ``max_timeout`` raises
    ``error`` with one line naming ``label``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise error(f"{label}={value!r}: expected a positive number of seconds, or None for no limit")
    if math.isinf(value):
        return None
    if value > LIMITS.max_timeout:
        raise error(f"{label}={value!r}: longer than the longest supported timeout ({LIMITS.max_timeout:.0f} s, "
                    f"about 24.8 days); use None for no limit")
    return float(value)


def guest_user(label: str, value: object, error: type[Exception] = ValueError) -> str | int:
    """A guest user as ``label`` was given it: a name (no ``:``, no surrounding blanks) or a uid.
    Anything else raises ``error`` with one line naming ``label``, before the guest is asked."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.strip() and ":" not in value and value == value.strip() and "\0" not in value:
        return value
    raise error(f"{label}={value!r}: expected a user name or uid known in the guest")


def guest_env(label: str, value: object, error: type[Exception] = ValueError) -> dict[str, str]:
    """Environment variables for the guest as ``label`` was given them: names and values that
    ``execve`` can carry (a name non-empty, without ``=``; neither with a NUL byte). Anything
    else raises ``error`` with one line naming ``label``, before the guest is asked."""
    if not isinstance(value, Mapping):
        raise error(f"{label}={value!r}: expected a dict of str to str")
    for name, text in value.items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise error(f"{label}: expected a dict of str to str, got {name!r}: {text!r}")
        if not name or "=" in name or "\0" in name or "\0" in text:
            raise error(f"{label}: {name!r} cannot be an environment variable (a name is non-empty, "
                        "without '=', and neither it nor its value may hold a NUL byte)")
    return dict(value)
