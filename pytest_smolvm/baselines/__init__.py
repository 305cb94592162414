"""Baselines: what a reference names and its digest (``baseline``), the host's cache of
unpacked trees (``cache``), archives and image layers (``archive``), and ``oci/`` for registry
images. Layers are unpacked through ``untrusted``; may import ``untrusted``, ``host``, ``errors``
and ``limits``, never ``session`` or ``backends``.
"""
