"""The ``smolvm`` Inspect sandbox's configuration: a TOML file or a Python object.

Keys are ``baseline``, ``environments`` (the sample's named guests, default first) and the
``smol`` marker's keywords; a bad key is one line naming the key and the file.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pytest_smolvm.errors import UsageError
from pytest_smolvm.session.settings import MARKER_KEYWORDS

# Only Inspect imports this module, and Inspect needs 3.11: tomllib is always there (mypy
# checks the package as 3.10, hence the import by name).
tomllib = importlib.import_module("tomllib")

GUEST_KEYS = ("cpus", "memory_mb", "network", "allow_hosts", "env", "user", "timeout", "output_limit", "relax")


class SmolvmSandboxConfig(BaseModel):
    """``Task(sandbox=("smolvm", SmolvmSandboxConfig(baseline=..., user="agent")))``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    baseline: str | None = None
    environments: tuple[str, ...] = ("default",)
    setup: tuple[str, ...] = ()
    cpus: float | None = None
    memory_mb: int | None = None
    network: bool = False
    allow_hosts: tuple[str, ...] = ()
    env: dict[str, str] = {}
    user: str | int | None = None
    timeout: float | None = None
    output_limit: int | str | None = None
    relax: tuple[str, ...] = ()

    def __hash__(self) -> int:
        # Inspect keys its sandbox cache by the task's config: pydantic's frozen hash fails on `env`.
        return hash(self.model_dump_json())

    def guest_keywords(self) -> dict[str, Any]:
        """The ``Session.create`` keywords this config sets (defaults left to the session)."""
        values = self.model_dump()
        return {k: values[k] for k in GUEST_KEYS if k in MARKER_KEYWORDS and k in self.model_fields_set}


def load(config: object) -> SmolvmSandboxConfig:
    """``config`` as Inspect hands it over: None, a TOML path, a model, or a model's dict."""
    if config is None:
        return SmolvmSandboxConfig()
    if isinstance(config, SmolvmSandboxConfig):
        return config
    if isinstance(config, dict):
        return _validated(config, "smolvm sandbox config")
    if isinstance(config, str | Path):
        path = Path(config)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise UsageError(f"smolvm sandbox config {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"smolvm sandbox config {path}: not TOML ({exc})") from None
        return _validated(data, str(path))
    raise UsageError(f"smolvm sandbox config: expected a TOML path or SmolvmSandboxConfig, "
                     f"got {type(config).__name__}")


def _validated(data: dict[str, Any], where: str) -> SmolvmSandboxConfig:
    fields = SmolvmSandboxConfig.model_fields
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r} (expected one of {', '.join(fields)})")
    from pydantic import ValidationError

    try:
        model = SmolvmSandboxConfig(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "?"
        raise UsageError(f"{where}: key {key!r}: {first['msg']}") from None
    if not model.environments or model.environments[0] != "default":
        raise UsageError(f"{where}: key 'environments': list the guests' names, 'default' first")
    return model
