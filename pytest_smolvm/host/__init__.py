"""This host's own state: where files live (``paths``), who a process is (``procs``), the
host-wide records of live guests (``registry``) and removing what dead owners left (``reaper``).

``paths``, ``procs`` and ``registry`` import only the standard library and ``errors``; the
reaper asks a backend (through ``backends``) to destroy what a record names.
"""
