"""This host's own state: where files live (``paths``), who a process is and on which host,
boot and pid namespace (``procs``), the host-wide records of live guests (``registry``),
which thread takes Ctrl-C, SIGTERM and SIGHUP while a destroy runs (``signals``), and the kept
threads blocking calls from an event loop run on (``threads``).

``paths``, ``procs``, ``registry``, ``signals`` and ``threads`` import only the standard library,
``errors`` and each other; the reaper (``session/reaper.py``) asks a backend to destroy what a record names.
"""
