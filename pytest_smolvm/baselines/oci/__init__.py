"""OCI images from registries as baselines: reference parsing, auth, a small pull client, a blob cache.

Import the module you need (``reference`` to check a name costs nothing; ``pull`` brings the
HTTP client, urllib and ssl): this package's ``__init__`` imports none of them.
"""
