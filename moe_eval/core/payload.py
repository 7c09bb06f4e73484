"""A payload field: a dataclass field with its description, which the results schema reads (pydantic takes
a field's `metadata={"description": ...}`), so a payload's type is its own schema: no mirror to keep."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any


def _never(value: Any) -> bool:
    return False


def described(doc: str, default: Any = MISSING, *, factory: Any = MISSING, newer: bool = False) -> Any:
    """A dataclass field documented by `doc`; without a default it is required. newer: a field records
    written before it lack (the schema does not require it; it is always written now)."""
    metadata: dict[str, Any] = {"description": doc}
    if newer:
        metadata["exclude_if"] = _never  # the schema's mark of a key that may be absent; nothing is excluded
    return field(default=default, default_factory=factory, metadata=metadata)
