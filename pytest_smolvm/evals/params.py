"""A test's parametrize values as a result line holds them.

The JSONL is one small line per episode: a value that JSON takes is kept as it is, any other
object as its text, and one whose JSON is longer than ``LIMITS.result_param_chars`` (a prompt,
a task's whole input, a config object) is referenced by the digest of that JSON, not embedded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from pytest_smolvm import limits


def value(raw: Any) -> Any:
    try:
        text = json.dumps(raw, allow_nan=False)
    except (TypeError, ValueError):
        raw = str(raw)  # objects, NaN: their text is what a reader of the results can use
        text = json.dumps(raw)
    if len(text) > limits.LIMITS.result_param_chars:
        return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text)}
    return raw


def of(params: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    return {name: value(raw) for name, raw in params}
