"""The namespace backend's helper process: a zygote that forks guests, and the guest's init.

These modules run as their own interpreter, started once per pytest process with an explicit,
minimal environment and an argv that names no host path (the guest can read its init's
``/proc/1/cmdline``): the host compiles them and sends the code on stdin, and the zygote loads
``MODULES`` in order into ``sys.modules`` (see ``namespace.zygote.helper_code``). They import
only the standard library and each other, all of it *before* any guest exists: a guest's init
pivots into the guest's root, after which nothing from the host's filesystem (``sys.path``
included) can be imported.

What confines a guest (see docs/security.md): namespaces (mount, pid, net, uts, ipc, cgroup,
and user when not root), a cgroup of its own, a seccomp filter the host compiled with
libseccomp (sent as BPF in each create request), a reduced capability set, and helper
processes (setup, init, per-request children) that are not dumpable, so the guest can neither
ptrace them, read their memory or environment, nor take their fds with ``pidfd_getfd``.

Why a zygote: forking the pytest process itself is unsafe (xdist workers run threads) and
costs a copy of a large address space per guest, and starting a fresh interpreter per guest
costs an interpreter's start each time; a small single-threaded process that forks on request
costs a fork (figures in docs/performance.md).

Processes per guest::

    zygote (child subreaper)
      └─ setup  (unshares namespaces, mounts the root, forks init, exits)
           └─ init  (pid 1 of the guest: reaps orphans, runs exec/file requests)
                └─ one child per request (setsid; execve, or a file operation)

The init serves a SOCK_SEQPACKET socket whose other end the pytest process holds. When that
end closes (the test process exited or crashed) the init exits, and the kernel kills every
process of the guest's pid namespace with it: a crashed test process cannot leave guest
processes or mounts behind. Only a guest marked ``keep`` outlives its owner.
"""

# The order the zygote loads them in: each imports only those before it.
MODULES = ("kernel", "disk", "diskpool", "writers", "unpack", "stage", "requests", "init", "setup", "zygote")
