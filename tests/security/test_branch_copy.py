"""A branch's host-side copy costs the host the guest's data, never more (the audit's sparse file).

``vm.branch`` on the namespace backend copies the parent's upper layer into the runtime dir (a
host tmpfs by default) by fds (backends/namespace/branch.py). ``copy_file_range`` writes a hole's
zeros there, and the copy's budget counted a file's size: a guest's ``truncate -s 1000M`` (no
block allocated, 0 used in its own ``df``) became 1000 MiB of host RAM in every branch, outside
the guest's memory cgroup, and several seconds of host work with the parent frozen. The copy now
writes a file's data extents only (its holes stay holes) and its byte budget counts what it
writes: data and xattrs. Its entry bound is counted as a directory is read, not after.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.backends.namespace import branch as nsbranch
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.backends.namespace.guest import NamespaceGuest
from pytest_smolvm.baselines.baseline import Baseline
from pytest_smolvm.errors import GuestError
from pytest_smolvm.handle.vm import VM

MIB = 1 << 20
GIB = 1 << 30


@pytest.fixture
def branch_of(ns_backend: NamespaceBackend, baseline: Baseline) -> Iterator[Callable[..., list[VM]]]:
    """``branch_of(vm, n=1, disk_mb=...)``: children of ``vm`` made by the backend's own branch
    (the host-side copy under test), destroyed after the test."""
    made: list[VM] = []

    def branch(parent: VM, n: int = 1, **spec: Any) -> list[VM]:
        guest = parent._guest
        assert isinstance(guest, NamespaceGuest)
        specs = [VMSpec(name=f"sec-{uuid.uuid4().hex[:10]}", baseline=baseline, **spec)
                 for _ in range(n)]
        children = [VM(child, backend="namespace", isolation="namespace")
                    for child in ns_backend.branch(guest, specs)]
        made.extend(children)
        return children

    yield branch
    for vm in made:
        vm._guest.destroy()


def _layer_file(child: VM, path: str) -> Path:
    """The host copy of the parent's ``path`` that ``child`` reads (its first lower layer)."""
    guest = child._guest
    assert isinstance(guest, NamespaceGuest)
    return guest.layers[0] / path.lstrip("/")


SPARSE = ("truncate -s 1G /workspace/sparse && "
          "printf head | dd of=/workspace/sparse conv=notrunc 2>/dev/null && "
          "printf middle | dd of=/workspace/sparse bs=1M seek=300 conv=notrunc 2>/dev/null && "
          f"printf tail | dd of=/workspace/sparse bs=1 seek={GIB - 4} conv=notrunc 2>/dev/null")


def test_a_sparse_gigabyte_branches_as_its_data_and_reads_the_same(
        make_vm: Callable[..., VM], branch_of: Callable[..., list[VM]]) -> None:
    """The audit's attack: 1 GiB of size, three pages of data. The copy is those pages (it was
    1 GiB of dense host memory), made in a fraction of a second of host work with the parent
    frozen (it was a kernel copy of 1 GiB of zeros), and the child reads every byte the same."""
    parent = make_vm()
    parent.exec(SPARSE, check=True)
    assert int(parent.exec("du -k /workspace/sparse").stdout.split()[0]) < 1024  # the guest holds ~12 KiB
    started, cpu = time.monotonic(), time.process_time()
    (child,) = branch_of(parent)
    took, host_cpu = time.monotonic() - started, time.process_time() - cpu
    copy = _layer_file(child, "/workspace/sparse")
    st = os.stat(copy, follow_symlinks=False)
    assert st.st_size == GIB
    assert st.st_blocks * 512 <= MIB, f"the host copy of a sparse 1 GiB file holds {st.st_blocks * 512 >> 10} KiB"
    assert host_cpu < 0.25 and took < 5.0, f"branch of a sparse 1 GiB file: {host_cpu:.2f}s of host CPU, {took:.2f}s"
    # The child reads the parent's file: 1 GiB long, its only non-zero bytes these, where they were written.
    assert child.exec("stat -c %s /workspace/sparse").stdout.strip() == str(GIB)
    assert child.exec("tr -d '\\0' < /workspace/sparse", timeout=60).stdout == "headmiddletail"
    assert child.exec("head -c 4 /workspace/sparse; dd if=/workspace/sparse bs=1M skip=300 count=1 2>/dev/null "
                      "| head -c 6; tail -c 4 /workspace/sparse").stdout == "headmiddletail"
    assert int(child.exec("du -k /workspace/sparse").stdout.split()[0]) < 1024


def test_sparse_files_far_past_the_disk_branch_and_real_data_still_counts(
        make_vm: Callable[..., VM], branch_of: Callable[..., list[VM]]) -> None:
    """Ten 10 GiB sparse files on a 64 MiB disk cost the copy their data (it refused them as
    100 GiB); data past the children's disk still fails the branch, leaving nothing."""
    parent = make_vm(disk_mb=64)
    parent.exec("for i in 0 1 2 3 4 5 6 7 8 9; do truncate -s 10G /workspace/s$i && "
                "printf x$i | dd of=/workspace/s$i bs=1M seek=4096 conv=notrunc 2>/dev/null || exit 1; done; "
                "head -c 12m /dev/urandom > /workspace/data", check=True)
    (child,) = branch_of(parent, disk_mb=64)
    assert child.exec("dd if=/workspace/s7 bs=1M skip=4096 count=1 2>/dev/null | head -c 2").stdout == "x7"
    assert child.exec("stat -c %s /workspace/s7").stdout.strip() == str(10 * GIB)
    digest = "md5sum < /workspace/data"
    assert child.exec(digest).stdout == parent.exec(digest).stdout != ""
    assert sum(os.stat(_layer_file(child, f"/workspace/s{i}")).st_blocks for i in range(10)) * 512 <= 10 * MIB
    layers = _layer_file(child, "/").parent.parent
    before = sorted(os.listdir(layers))
    with pytest.raises(GuestError, match="hold more than 8 MiB"):
        branch_of(parent, disk_mb=8)  # 12 MiB of data for a child's 8 MiB disk
    assert sorted(os.listdir(layers)) == before, "a refused branch left a layer behind"
    assert parent.exec("true").exit_code == 0


def _copy_refused(src: Path, dest: Path, budget_bytes: int, why: str) -> None:
    """The branch copy of the host tree ``src`` (standing in for a guest's upper) fails: ``why``."""
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(GuestError, match=why):
            nsbranch._copy_into(fd, dest, nsbranch._Budget(budget_bytes), link=False)
    finally:
        os.close(fd)


def test_xattrs_count_in_the_copys_bytes(tmp_path: Path) -> None:
    """Xattrs were copied outside the byte budget: 400 empty files with a 3,000-byte xattr each
    passed a 1 MiB budget."""
    src = tmp_path / "upper"
    src.mkdir()
    try:
        for i in range(400):
            (src / f"f{i}").write_bytes(b"")
            os.setxattr(src / f"f{i}", "user.pad", b"x" * 3000)
    except OSError as e:
        pytest.skip(f"no user xattrs on {tmp_path}: {e}")
    _copy_refused(src, tmp_path / "copy", MIB, "hold more than 1 MiB")


def test_a_huge_directory_is_refused_while_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry bound was checked after a whole directory's names were listed into memory: a
    directory of ten million names was held whole first. Now at most the bound is read."""
    src = tmp_path / "upper"
    (src / "d").mkdir(parents=True)
    for i in range(3000):
        (src / "d" / f"n{i}").touch()
    monkeypatch.setattr(nsbranch, "MAX_ENTRIES", 100)
    real_scandir = os.scandir
    read = []

    class Counting:
        def __init__(self, fd: int) -> None:
            self.inner = real_scandir(fd)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.close()

        def __iter__(self) -> Iterator[os.DirEntry[str]]:
            for entry in self.inner:
                read.append(entry.name)
                yield entry

    monkeypatch.setattr(os, "scandir", Counting)
    try:
        _copy_refused(src, tmp_path / "copy", GIB, "more than 100 entries")
    finally:
        monkeypatch.undo()
    assert len(read) <= 102, f"{len(read)} names read for a bound of 100"
