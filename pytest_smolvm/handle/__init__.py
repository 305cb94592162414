"""The guest handle tests and loops hold: ``base.GuestHandle`` (every operation, written once),
``vm.VM`` (adds ``.aio``), ``aio.AsyncVM`` (built from the same methods), ``result`` (values).

Talks to a guest only through ``backends.base.Guest``; may import ``backends.base``,
``untrusted``, ``errors`` and ``limits``.
"""
