"""docs/results.schema.json and docs/summary.schema.json, generated from the record's types
(moe_eval.core.record).

    python -m moe_eval.core.record_schema [--write]     (print, or write both files under docs/)

A test holds the committed files to what this generates, so the schema cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from moe_eval.core import record as rec
from moe_eval.core.check import CHECK_STATUSES, VERDICTS, Check

DOCS = Path(__file__).resolve().parents[2] / "docs"
GENERATED = (
    "Generated from moe_eval/core/record.py by `python -m moe_eval.core.record_schema --write`; do not edit."
)
FILES = {"results.schema.json": "results", "summary.schema.json": "summary"}


def type_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a Python type as the record writes it."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [type_schema(a) for a in typing.get_args(hint)]
        return {"anyOf": options}
    if hint is type(None):
        return {"type": "null"}
    if hint is Any:
        return {}
    if hint is str:
        return {"type": "string"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:  # NaN and infinities are written as null
        return {"type": ["number", "null"]}
    if origin is list:
        return {"type": "array", "items": type_schema(typing.get_args(hint)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": type_schema(typing.get_args(hint)[1])}
    if hint is Check:
        return {
            "type": "object",
            "required": ["name", "passed", "detail"],
            "properties": {
                "name": {"type": "string"},
                "passed": {"type": "boolean"},
                "detail": {"type": "string"},
                "status": {
                    "enum": list(CHECK_STATUSES),
                    "description": "passed, failed, not_run (required, could not measure: the row is "
                    "incomplete) or skipped (optional here, could not measure)",
                },
                "ran": {
                    "const": False,
                    "description": "present only for a gate called for that could not run",
                },
            },
        }
    if dataclasses.is_dataclass(hint):
        return object_schema([hint])
    raise TypeError(f"record_schema: no JSON schema for {hint!r}")


def object_schema(classes: list[type]) -> dict[str, Any]:
    """One JSON object holding the fields of every class given (a record's sections share one object)."""
    properties, required = {}, []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            schema = type_schema(hints[f.name])
            if "enum" in f.metadata:
                schema = {"enum": list(f.metadata["enum"]) + ([None] if _nullable(hints[f.name]) else [])}
            if "pattern" in f.metadata:
                schema["pattern"] = f.metadata["pattern"]
            if f.metadata.get("doc"):
                schema["description"] = f.metadata["doc"]
            properties[f.name] = schema
            if not f.metadata.get(rec.OPTIONAL):
                required.append(f.name)
    return {"type": "object", "required": required, "properties": properties}


def _nullable(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def results_schema() -> dict[str, Any]:
    body = object_schema(list(rec.SECTION_TYPES.values()))
    body["properties"] = {
        "schema_version": {"const": rec.RESULTS_SCHEMA_VERSION, "description": rec.SCHEMA_HISTORY}
    } | body["properties"]
    body["required"] = ["schema_version", *body["required"]]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "moe-eval/results.schema.json",
        "title": "moe-eval results.json (one config of one run)",
        "description": (
            f"{GENERATED} Written atomically by `moe-eval run` in <run>/<family>/<config>/results.json. "
            "Sections in the "
            "code (identity, environment, serving, evaluation, captures, judged, verdict, bookkeeping) are "
            "keys of one object here. A config with a verdict (passed, failed, incomplete) has its "
            "evaluation's keys; one without (error, cancelled) has an 'error' object."
        ),
        **body,
        "if": {"properties": {"status": {"enum": list(VERDICTS)}}},
        "then": {"required": ["scores", "num_questions_evaluated", "answers", "gate", "samples"]},
        "else": {"required": ["error"]},
    }


def summary_schema() -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "moe-eval/summary.schema.json",
        "title": "moe-eval summary.json (one run)",
        "description": (
            f"{GENERATED} Written atomically by `moe-eval run` in the run folder after every config ended."
        ),
        **object_schema([rec.RunSummary]),
    }


def rendered() -> dict[str, str]:
    """Each file's text, as committed."""
    made = {"results": results_schema(), "summary": summary_schema()}
    return {name: json.dumps(made[kind], indent=2) + "\n" for name, kind in FILES.items()}


def main(argv: list[str]) -> int:
    for name, text in rendered().items():
        if "--write" in argv:
            (DOCS / name).write_text(text)
            print(f"wrote {DOCS / name}")
        else:
            print(f"# {name}\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
