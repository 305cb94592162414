"""Defaults every backend applies alike, so a test behaves the same on a laptop's microVM, on
smol cloud and on a CI host's namespace guests."""

from __future__ import annotations

# A guest's memory when its marker names none, on every backend (``memory_mb`` overrides it
# everywhere). 4 GiB let one namespace guest take most of a small CI host, and a test that
# passed there could OOM in a 512 MiB microVM. 2 GiB fits a Python toolchain and an agent's
# build. It is what the guest's processes get, as a microVM's RAM: a namespace guest's files
# live in its tmpfs disk, charged to the same cgroup, so that cgroup's limit adds the disk's
# size (cgroups.create), and filling the disk is ENOSPC rather than a kill for memory.
DEFAULT_MEMORY_MB = 2048
