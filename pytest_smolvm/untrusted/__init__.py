"""Everything that reads bytes a guest or an image made: the tar parser (``tarstream``), the
caps and policies (``rules``), fd-only tree walks (``walk``), the extractor (``hostfs``), the
same extractor in a confined helper process (``confined``), and guests' DNS queries
(``dnswire``). Guest text made inert is one room down (``pytest_smolvm.inert``): every error's
message passes through it.

The host never resolves a path inside a tree the guest wrote: every consumer goes through
``confined.extract``, and the in-process walker is the second wall. Imports only the standard
library, ``errors``, ``inert`` and ``limits``, so the confined helper loads nothing else.
"""
