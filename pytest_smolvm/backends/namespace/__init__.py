"""The namespace backend: guests made of Linux namespaces, a cgroup, a seccomp filter and an
overlay root, for hosts where no microVM boots.

``backend`` (the Backend), ``guest`` (one guest, host side), ``zygote`` (starting the helper),
``channel`` (one request to a guest's init), ``cgroups``, ``seccomp``, ``network`` (pasta),
``dns`` (the guests' DNS proxy), ``shell`` (``pytest-smolvm shell``), and ``helper/``: the code
that runs in the helper process and as each guest's init (standard library only). Imported only
through ``backends``.
"""
