"""Peak RSS of a pytest run: every process's own peak (VmHWM), summed, not only the largest one.

``ru_maxrss`` of the children is the largest single process; a run under ``-n 2`` is three
Python processes (the controller and two workers), each with its own peak. The processes of
one session (the run is started with ``start_new_session=True``) are sampled every 0.2 s.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


class PeakRss:
    """Every Python process's own peak (VmHWM) in pytest's session (the controller and its workers), sampled."""

    def __init__(self, session: int) -> None:
        self.session = session
        self.peaks: dict[tuple[int, str], int] = {}  # (pid, start time) -> kB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                fields = stat.rpartition(")")[2].split()
                if int(fields[3]) != self.session:  # field 6, the session id
                    continue
                if not Path(f"/proc/{entry.name}/comm").read_text().startswith("python"):
                    continue  # pytest and its xdist workers (whose command line is execnet's)
                status = Path(f"/proc/{entry.name}/status").read_text()
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
            key = (int(entry.name), fields[19])  # pid and start time: pids are reused
            self.peaks[key] = max(self.peaks.get(key, 0), hwm)

    def total_mb(self) -> float:
        return sum(self.peaks.values()) / 1024

    def largest_mb(self) -> float:
        return max(self.peaks.values(), default=0) / 1024
