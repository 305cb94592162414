"""Evals: the ``smol_episodes`` marker, result lines (JSONL), the eval summary, and ``results/``,
the viewer behind ``pytest-smolvm results``. May import ``session``, ``handle`` and below; the
viewer imports nothing of pytest or of guests.
"""
