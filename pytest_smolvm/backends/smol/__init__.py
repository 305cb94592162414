"""The smol backend: smolmachines microVMs, local (libkrun) or on smol cloud.

``backend`` (the Backend: sources, branches, targets), ``guest`` and ``exec_plumbing`` (one
machine), ``handle`` (SDK exec and stream helpers), ``common``, ``reap`` (by label), ``shell``,
``sdk`` (every SDK behaviour the public API does not promise), ``probe`` (does a microVM really
boot here?) and ``doctor`` (that answer explained). ``import smol`` happens inside functions
only: it changes ``os.environ``. Imported only through ``backends`` and ``cli``.
"""
