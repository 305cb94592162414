"""This host's own state: where files live (``paths``), who a process is and on which host,
boot and pid namespace (``procs``), the host-wide records of live guests (``registry``), and
which thread takes Ctrl-C, SIGTERM and SIGHUP while a destroy runs (``signals``).

``paths``, ``procs``, ``registry`` and ``signals`` import only the standard library and
``errors``; the reaper (``session/reaper.py``) asks a backend to destroy what a record names.
"""
