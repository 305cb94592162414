"""The pytest face: hooks and fixtures (``hooks``, the pytest11 entry point), hookspecs, report
sinks, progress lines, collected artifacts, async tests without an async plugin.

Thin glue over ``session`` (the run and its guests), ``evals`` and ``handle``. Nothing else in
the package imports from here, so the library API and the Inspect provider never load pytest's
hooks. Importing this package costs nothing: ``hooks`` imports the rest lazily.
"""
