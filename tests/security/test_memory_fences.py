"""Issue 42: a guest's TCP buffers are its own memory, not the host's.

cgroup v1 charges socket memory to no cgroup until ``memory.kmem.tcp.limit_in_bytes`` is set:
a guest with ``memory_mb=64`` queued 512 MiB of host kernel memory on loopback sockets nobody
reads (its cgroup charged 2 MiB). A static program (``tcpqueue.c``, built here like the probe)
opens connections to a listener of its own that never reads and writes each until the kernel
says EAGAIN; harmless to the host once the fence holds, and bounded by the host's own
``tcp_mem`` if it does not.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_smolvm.backends.namespace.guest import NamespaceGuest
from pytest_smolvm.handle.vm import VM
from tests import tools

SOURCE = Path(__file__).with_name("tcpqueue.c")
MIB = 1 << 20


@pytest.fixture(scope="session")
def tcpqueue(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = tools.require("gcc", "to build the static socket-queue program")
    out = tmp_path_factory.mktemp("tcpqueue") / "tcpqueue"
    result = subprocess.run([gcc, "-static", "-O1", "-o", str(out), str(SOURCE)], capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0:
        tools.missing("libc6-dev", f"gcc -static failed: {result.stderr.strip()[-300:]}")
    return out


def test_a_guests_socket_buffers_are_charged_to_its_memory_limit(make_vm: Callable[..., VM], tcpqueue: Path) -> None:
    vm = make_vm(memory_mb=64)
    guest = vm._guest
    assert isinstance(guest, NamespaceGuest)
    memory = [d for d in guest.cgroup_dirs if Path(d, "memory.limit_in_bytes").exists()]
    if not memory:
        pytest.skip("no cgroup v1 memory controller here (cgroup v2 charges socket memory to memory.max itself)")
    if not Path(memory[0], "memory.kmem.tcp.limit_in_bytes").exists():
        pytest.skip("this kernel's cgroup v1 has no memory.kmem.tcp.* (socket memory cannot be charged)")
    vm.copy_in(str(tcpqueue), "/tcpqueue")
    result = vm.exec("/tcpqueue 48", check=True)  # unfenced: ~190 MiB on this host
    queued = int(result.stdout.split("queued=")[1])
    assert queued <= 80 * MIB, f"{queued / MIB:.0f} MiB of host kernel memory queued by a 64 MiB guest"
    assert int(Path(memory[0], "memory.kmem.tcp.limit_in_bytes").read_text()) == 64 * MIB
    assert int(Path(memory[0], "memory.kmem.tcp.max_usage_in_bytes").read_text()) > 32 * MIB  # charged, here
