"""JSON schemas that structured-output tests and benchmarks share, each with a valid instance.

They cover what applications send: nested objects, arrays with bounds, enums, numbers with
bounds, ``anyOf``, optional and required fields, ``$defs`` references, string formats and
patterns. ``instance`` validates against ``schema`` (``tests/structured_output`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    instance: Any


SCHEMA_CASES: tuple[SchemaCase, ...] = (
    SchemaCase(
        "flat-object",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada", "age": 36},
    ),
    SchemaCase(
        "nested-object",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string"},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            },
                            "required": ["city", "zip"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["id", "address"],
                    "additionalProperties": False,
                }
            },
            "required": ["user"],
            "additionalProperties": False,
        },
        {"user": {"id": 7, "address": {"city": "Paris", "zip": "75001"}}},
    ),
    SchemaCase(
        "array-of-strings",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 1,
                    "maxItems": 4,
                },
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
        {"tags": ["a", "b"]},
    ),
    SchemaCase(
        "enum",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
        {"color": "green"},
    ),
    SchemaCase(
        "bounded-numbers",
        {
            "type": "object",
            "properties": {
                "score": {"type": "integer", "minimum": 0, "maximum": 100},
                "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["score", "ratio"],
            "additionalProperties": False,
        },
        {"score": 42, "ratio": 0.5},
    ),
    SchemaCase(
        "any-of",
        {
            "type": "object",
            "properties": {
                "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
            },
            "required": ["value"],
            "additionalProperties": False,
        },
        {"value": "eight"},
    ),
    SchemaCase(
        "optional-fields",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "subtitle": {"type": "string"},
                "pages": {"type": "integer"},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
        {"title": "Octavo", "pages": 8},
    ),
    SchemaCase(
        "array-of-objects",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                    "maxItems": 3,
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        {"items": [{"sku": "x1", "qty": 2}]},
    ),
    SchemaCase(
        "defs-ref",
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"],
            "additionalProperties": False,
        },
        {"start": {"x": 0, "y": 1.5}, "end": {"x": 2, "y": -3}},
    ),
    SchemaCase(
        "booleans-and-null",
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
            "required": ["ok", "note"],
            "additionalProperties": False,
        },
        {"ok": True, "note": None},
    ),
    SchemaCase(
        "string-lengths",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4}},
            "required": ["code"],
            "additionalProperties": False,
        },
        {"code": "abc"},
    ),
    SchemaCase(
        "const-and-nested-array",
        {
            "type": "object",
            "properties": {
                "version": {"const": 1},
                "matrix": {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                    "maxItems": 3,
                },
            },
            "required": ["version", "matrix"],
            "additionalProperties": False,
        },
        {"version": 1, "matrix": [[1, 2], [3]]},
    ),
)


def bounded(schema: Any) -> Any:
    """``schema`` with every output made finite, for models with random weights.

    A random model picks among all allowed tokens, so an unbounded string, array or number
    may fill ``max_tokens``; this adds ``maxLength`` 6 to strings without a length, pattern,
    enum or const, ``maxItems`` 3 to arrays, a ``maximum`` to integers and numbers, and
    ``multipleOf`` 0.25 to numbers. With ``without_whitespace`` too, whatever the model picks
    is short and complete, and still valid against the original schema.
    """
    if isinstance(schema, list):
        return [bounded(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded(value) for key, value in schema.items()}
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
    if (
        "string" in kinds
        and not {"maxLength", "pattern", "enum", "const", "format"} & schema.keys()
    ):
        out["maxLength"] = 6
    if "array" in kinds and "maxItems" not in schema:
        out["maxItems"] = 3
    if kinds & {"integer", "number"} and "maximum" not in schema:
        out.setdefault("minimum", 0)
        out["maximum"] = out["minimum"] + 999
    if "number" in kinds and "multipleOf" not in schema:
        out["multipleOf"] = 0.25  # finitely many fraction digits
    return out


def without_whitespace(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` telling llguidance to allow no whitespace between JSON tokens."""
    return {**schema, "x-guidance": {"whitespace_flexible": False}}
