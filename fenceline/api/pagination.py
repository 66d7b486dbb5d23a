"""Keyset cursor pagination, the one way every list that can grow is paged.

A list endpoint declares ``query=page_query()`` (``limit`` 1..100, default 50, out of range is
a 400, and ``cursor``) and answers ``page_schema(item)``: ``{"items": [...], "next_cursor":
<string or null>}``. The cursor is opaque to clients: base64url (unpadded) of a JSON array of
the sort key values of the last row returned. ``next_cursor`` is null exactly when there is
nothing after this page (the handler fetches ``limit + 1`` rows to know), so a client never
needs an extra empty request.

Usage in a handler, for a list ordered by (created_at desc, id desc)::

    limit = page_limit(call.query)
    after = decode_cursor(call.query, ("timestamp", "uuid"))
    rows = ... where (created_at, id) < (%s, %s) when after is not None ... limit %s
                (limit + 1)
    items, next_cursor = make_page(rows, limit, lambda r: [r[0], r[1]])
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fenceline.api.problems import Problem
from fenceline.api.validation import INT64_MAX, Schema, array, integer, obj, string

DEFAULT_LIMIT = 50
MAX_LIMIT = 100
MAX_CURSOR = 2000

LIMIT = integer(1, MAX_LIMIT, description=f"Page size, 1-{MAX_LIMIT}; default {DEFAULT_LIMIT}.")
CURSOR = string(1, MAX_CURSOR, description="next_cursor of the previous page.")

# The kinds of value a cursor can carry, as they travel in the JSON array.
KINDS = ("uuid", "timestamp", "int", "str")

T = TypeVar("T")


def page_query(**extra: Schema) -> dict[str, Schema]:
    """The query parameters of a paged list, plus the endpoint's own filters."""
    return {"limit": LIMIT, "cursor": CURSOR, **extra}


def page_schema(item: Schema) -> Schema:
    return obj({"items": array(item),
                "next_cursor": string(nullable=True,
                                      description="Pass as cursor for the next page; "
                                                  "null on the last page.")},
               ["items", "next_cursor"])


def page_limit(query: dict[str, Any]) -> int:
    limit: int = query.get("limit", DEFAULT_LIMIT)
    return limit


def invalid_cursor(detail: str = "the cursor is not one this list gave out") -> Problem:
    return Problem(400, "invalid_cursor", "Invalid cursor", detail, field="cursor")


def encode_cursor(values: Sequence[Any]) -> str:
    """The cursor for a row whose sort key is ``values``."""
    out: list[Any] = []
    for value in values:
        if isinstance(value, uuid.UUID):
            out.append(str(value))
        elif isinstance(value, dt.datetime):
            if value.tzinfo is None:
                raise ValueError("cursor timestamps must carry a time zone")
            out.append(value.astimezone(dt.UTC).isoformat())
        elif isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError(f"cannot put {type(value).__name__} in a cursor")
        else:
            out.append(value)
    raw = json.dumps(out, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_cursor(query: dict[str, Any], kinds: Sequence[str]) -> list[Any] | None:
    """The sort key carried by ``query["cursor"]``, parsed to ``kinds``; None when absent.

    Anything that is not exactly what ``encode_cursor`` made for this list (bad base64, not
    JSON, wrong length, wrong kinds) is a 400 ``invalid_cursor``.
    """
    raw = query.get("cursor")
    if raw is None:
        return None
    try:
        text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()
        values = json.loads(text)
    except (binascii.Error, ValueError, UnicodeDecodeError, RecursionError):
        raise invalid_cursor() from None
    if not isinstance(values, list) or len(values) != len(kinds):
        raise invalid_cursor()
    return [_parse(kind, value) for kind, value in zip(kinds, values, strict=True)]


def _parse(kind: str, value: Any) -> Any:
    if kind == "uuid" and isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            raise invalid_cursor() from None
    if kind == "timestamp" and isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value)
        except ValueError:
            raise invalid_cursor() from None
        if parsed.tzinfo is None:
            raise invalid_cursor()
        return parsed
    if (kind == "int" and isinstance(value, int) and not isinstance(value, bool)
            and -INT64_MAX - 1 <= value <= INT64_MAX):
        return value
    if kind == "str" and isinstance(value, str) and "\x00" not in value:
        return value
    if kind not in KINDS:
        raise ValueError(f"unknown cursor kind {kind!r}")
    raise invalid_cursor()


def make_page(rows: Sequence[T], limit: int, key: Callable[[T], Sequence[Any]],
              ) -> tuple[list[T], str | None]:
    """The first ``limit`` rows, and the cursor after them if more rows were fetched.

    Fetch ``limit + 1`` rows so that the last page says so (``next_cursor`` null).
    """
    items = list(rows[:limit])
    if len(rows) <= limit or not items:
        return items, None
    return items, encode_cursor(key(items[-1]))
