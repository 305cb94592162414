"""OCI images from registries as baselines: reference parsing, auth, a small pull client, a blob cache."""

from __future__ import annotations

from pytest_smolvm.baselines.oci.client import RegistryError
from pytest_smolvm.baselines.oci.pull import pin_registry_image, resolve_image, unpack_image

__all__ = ["RegistryError", "pin_registry_image", "resolve_image", "unpack_image"]
