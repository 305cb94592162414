"""A run and its guests, usable without pytest: settings (validated input), a guest's resolved
spec (``spec``: the one place a fallback is applied), the run (``run``), the one decision per
run (``plan``, and its service for xdist workers), the per-process guest pool (``pool``) and its
background work, admission (host-wide slots), the warm-baseline setup, and the library API (``library.Session``).

May import ``handle``, ``backends``, ``baselines``, ``untrusted``, ``host``, ``errors`` and
``limits``; never ``plugin`` or ``evals``.
"""
