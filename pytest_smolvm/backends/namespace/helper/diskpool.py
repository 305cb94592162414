"""The zygote's pool of guests' ext4 disks: each lent to one guest at a time, cleaned between
guests, and the work between guests done in the zygote's quiet moments (``DiskPool``). One
disk's making, clean and drop: ``disk``. Part of the namespace backend's helper (see
``__init__``): standard library only.
"""

from __future__ import annotations

import os
from typing import Any

from pytest_smolvm.backends.namespace.helper.disk import Disk, clean, make

# Idle disks kept for later guests, all sizes together: as many as were ever lent at once (the
# next guests will likely be as many), at least IDLE_MIN. Beyond it the longest idle is dropped.
IDLE_MIN = 8
QUIET_MS = 1  # how long the zygote has had nothing to serve before it does the work between guests


class DiskPool:
    """The zygote's disks: lent to one guest at a time, cleaned between guests (module docstring).

    The work between guests is done when the zygote has had nothing to do for ``QUIET_MS``
    (``settle``): a disk whose guest is gone is cleaned then, not at once, and a disk is made
    ahead for a size whose last clean one was just lent. So the next guest of a serial run takes
    a clean disk at once while its predecessor's is cleaned in the next quiet moment, and no
    clean (~0.25 ms, its guest's dir removed and the next's made) or drop (a fork) holds up a
    create the owner sent meanwhile. A guest that finds no clean disk of its size gets a
    returned one cleaned at once, else a new one."""

    def __init__(self) -> None:
        self.idle: list[Disk] = []
        self.returned: list[Disk] = []  # their guests are gone; not yet cleaned or dropped
        self.ahead: dict[tuple[str, int], dict[str, Any]] = {}  # sizes to make a disk ahead for
        self.lent = self.peak_lent = 0

    def take(self, request: dict[str, Any]) -> Disk:
        """A disk of ``request``'s template and size: an idle clean one, else a returned one
        cleaned now, else a new one."""
        key = (str(request["template"]), int(request["bytes"]))
        found = self._idle(key)
        while found is None and (returned := next((d for d in self.returned if d.key == key), None)):
            self.returned.remove(returned)
            if self._cleaned(returned):
                found = self._idle(key)
        found = found or make(request, key)
        self.lent += 1
        self.peak_lent = max(self.peak_lent, self.lent)
        if not self._has_idle(key):
            self.ahead[key] = request
        return found

    def _has_idle(self, key: tuple[str, int]) -> bool:
        return any(disk.key == key for disk in self.idle)

    def _idle(self, key: tuple[str, int]) -> Disk | None:
        for disk in self.idle:
            if disk.key == key:
                self.idle.remove(disk)
                if os.fstatvfs(disk.mount).f_flag & os.ST_RDONLY:  # ext4 remounted it after an error
                    disk.drop()
                    return None
                return disk
        return None

    def give_back(self, disk: Disk, *, clean: bool = True) -> None:
        """``disk``'s guest is gone, all of its processes: keep it to be cleaned for the next
        (``settle``), or drop it now (``clean=False``: its guest was never made)."""
        self.lent -= 1
        if clean:
            self.returned.append(disk)
        else:
            disk.drop()

    def unsettled(self) -> bool:
        """Whether ``settle`` has work."""
        return bool(self.returned or self.ahead)

    def settle(self) -> None:
        """One piece of the work between guests: clean (or drop) the longest returned disk, else
        make a disk ahead for a size that has no clean one."""
        if self.returned:
            self._cleaned(self.returned.pop(0))
            return
        key, request = self.ahead.popitem()
        if self._has_idle(key):
            return
        try:
            self._keep(make(request, key))
        except Exception:  # the zygote outlives any one disk; the guest that needs one says why it cannot
            pass

    def _cleaned(self, disk: Disk) -> bool:
        """Clean ``disk`` into the idle ones, or drop it (False). The zygote must outlive any
        one disk: one that fails even to drop is let go (its fds closed)."""
        try:
            if not clean(disk):
                disk.drop()
                return False
        except Exception:
            disk.close()
            return False
        self._keep(disk)
        return True

    def _keep(self, disk: Disk) -> None:
        self.idle.append(disk)
        while len(self.idle) > max(IDLE_MIN, self.peak_lent):
            self.idle.pop(0).drop()  # the longest idle: its size is the least likely asked for next
