"""Request schemas, written once as JSON Schema and used twice: to check input and to publish it.

The builders below make plain JSON Schema (2020-12, as OpenAPI 3.1 uses) dicts; ``check``
validates a decoded JSON value against one and raises a 400 ``Problem`` that names the first
offending field. Only the keywords the builders emit are supported, on purpose: the published
document can never promise a rule that ``check`` does not enforce.

Objects reject unknown fields (``additionalProperties: false``) unless told otherwise: a typo
in a field name is an error, not a silently ignored setting.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from fenceline.api.problems import Problem

Schema = dict[str, Any]

# JSON numbers that PostgreSQL's integer and bigint columns can hold.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+$")


# -- builders ----------------------------------------------------------------------------


def string(min_length: int = 0, max_length: int | None = None, *, fmt: str | None = None,
           enum: Iterable[str] | None = None, nullable: bool = False,
           description: str | None = None) -> Schema:
    schema: Schema = {"type": ["string", "null"] if nullable else "string"}
    if enum is not None:
        schema["enum"] = list(enum) + ([None] if nullable else [])
    if min_length:
        schema["minLength"] = min_length
    if max_length is not None:
        schema["maxLength"] = max_length
    if fmt is not None:
        schema["format"] = fmt
    return _describe(schema, description)


def integer(minimum: int | None = None, maximum: int | None = INT32_MAX, *,
            nullable: bool = False, description: str | None = None) -> Schema:
    schema: Schema = {"type": ["integer", "null"] if nullable else "integer"}
    schema["minimum"] = -INT32_MAX - 1 if minimum is None else minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return _describe(schema, description)


def number(minimum: float | None = None, maximum: float | None = None, *,
           nullable: bool = False, description: str | None = None) -> Schema:
    schema: Schema = {"type": ["number", "null"] if nullable else "number"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return _describe(schema, description)


def boolean(description: str | None = None) -> Schema:
    return _describe({"type": "boolean"}, description)


def array(items: Schema, min_items: int = 0, max_items: int | None = None, *,
          unique: bool = False, description: str | None = None) -> Schema:
    schema: Schema = {"type": "array", "items": items}
    if min_items:
        schema["minItems"] = min_items
    if max_items is not None:
        schema["maxItems"] = max_items
    if unique:
        schema["uniqueItems"] = True
    return _describe(schema, description)


def obj(properties: Mapping[str, Schema], required: Iterable[str] = (), *,
        additional: bool = False, description: str | None = None) -> Schema:
    schema: Schema = {"type": "object", "properties": dict(properties),
                      "additionalProperties": additional}
    req = list(required)
    if req:
        schema["required"] = req
    return _describe(schema, description)


def any_json(description: str | None = None) -> Schema:
    """Any JSON value (a job payload)."""
    return _describe({}, description)


def uuid_string(nullable: bool = False, description: str | None = None) -> Schema:
    return string(fmt="uuid", nullable=nullable, description=description)


def timestamp(nullable: bool = False, description: str | None = None) -> Schema:
    return string(fmt="date-time", nullable=nullable, description=description)


def email(description: str | None = None) -> Schema:
    return string(3, 254, fmt="email", description=description)


def _describe(schema: Schema, description: str | None) -> Schema:
    if description:
        schema["description"] = description
    return schema


# -- checking ----------------------------------------------------------------------------


def invalid(where: str, message: str) -> Problem:
    field = where or "body"
    return Problem(400, "invalid_input", "Invalid input", f"{field}: {message}", field=field)


def check(schema: Schema, value: Any, where: str = "") -> Any:
    """Validate ``value``; return it with string formats parsed (uuid, date-time)."""
    types = schema.get("type")
    if types is not None:
        allowed = types if isinstance(types, list) else [types]
        if value is None:
            if "null" in allowed:
                return None
            raise invalid(where, "must not be null")
        kind = _json_kind(value)
        if kind not in allowed and not (kind == "integer" and "number" in allowed):
            raise invalid(where, f"must be {' or '.join(t for t in allowed if t != 'null')}, "
                                 f"got {kind}")
    if "enum" in schema and value not in schema["enum"]:
        options = ", ".join(str(v) for v in schema["enum"] if v is not None)
        raise invalid(where, f"must be one of {options}")
    if isinstance(value, str):
        return _check_string(schema, value, where)
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return _check_number(schema, value, where)
    if isinstance(value, list):
        return _check_array(schema, value, where)
    if isinstance(value, dict) and schema.get("type") == "object":
        return _check_object(schema, value, where)
    return value


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() and math.isfinite(value) else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _check_string(schema: Schema, value: str, where: str) -> Any:
    if len(value) < schema.get("minLength", 0):
        raise invalid(where, "must not be empty" if schema["minLength"] == 1
                      else f"must be at least {schema['minLength']} characters")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        raise invalid(where, f"must be at most {schema['maxLength']} characters")
    if "\x00" in value:
        raise invalid(where, "must not contain NUL characters")
    fmt = schema.get("format")
    if fmt == "uuid":
        try:
            return uuid.UUID(value)
        except ValueError:
            raise invalid(where, "must be a UUID") from None
    if fmt == "date-time":
        return parse_timestamp(value, where)
    if fmt == "email" and not _EMAIL.match(value.strip()):
        raise invalid(where, "must be an email address")
    return value


def parse_timestamp(value: str, where: str) -> dt.datetime:
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise invalid(where, "must be an RFC 3339 timestamp") from None
    if parsed.tzinfo is None:
        raise invalid(where, "must carry a time zone offset (for example Z)")
    return parsed


def _check_number(schema: Schema, value: float, where: str) -> float:
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid(where, "must be a finite number")
    if "minimum" in schema and value < schema["minimum"]:
        raise invalid(where, f"must be at least {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        raise invalid(where, f"must be at most {schema['maximum']}")
    if schema.get("type") in ("integer", ["integer", "null"]):
        return int(value)
    return value


def _check_array(schema: Schema, value: list[Any], where: str) -> list[Any]:
    if len(value) < schema.get("minItems", 0):
        raise invalid(where, f"must have at least {schema['minItems']} items")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        raise invalid(where, f"must have at most {schema['maxItems']} items")
    items = schema.get("items", {})
    out = [check(items, item, f"{where}[{i}]") for i, item in enumerate(value)]
    if schema.get("uniqueItems") and len({repr(v) for v in out}) != len(out):
        raise invalid(where, "must not repeat an item")
    return out


def _check_object(schema: Schema, value: dict[str, Any], where: str) -> dict[str, Any]:
    props: dict[str, Schema] = schema.get("properties", {})
    prefix = f"{where}." if where else ""
    for name in schema.get("required", []):
        if name not in value:
            raise invalid(f"{prefix}{name}", "is required")
    out: dict[str, Any] = {}
    for name, item in value.items():
        if name in props:
            out[name] = check(props[name], item, f"{prefix}{name}")
        elif schema.get("additionalProperties", False) is False:
            raise invalid(f"{prefix}{name}", "is not a known field")
        else:
            out[name] = item
    return out
