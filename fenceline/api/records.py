"""What the tenancy modules share: names, rows as dicts, unique writes, partial updates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from fenceline.api.endpoint import Call
from fenceline.api.problems import Problem
from fenceline.api.validation import invalid, string

NAME = string(1, 200, description="1-200 characters; surrounding spaces are trimmed.")


def clean_name(value: str, field: str = "name") -> str:
    """A name as stored: trimmed, and not empty once trimmed."""
    name = value.strip()
    if not name:
        raise invalid(field, "must not be blank")
    return name


async def dict_rows(cur: psycopg.AsyncCursor[Any]) -> list[dict[str, Any]]:
    assert cur.description is not None
    names = [c.name for c in cur.description]
    return [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]


async def dict_row(cur: psycopg.AsyncCursor[Any], missing: Problem) -> dict[str, Any]:
    rows = await dict_rows(cur)
    if not rows:
        raise missing
    return rows[0]


def name_taken(what: str) -> Problem:
    return Problem(409, "name_taken", "Name taken", f"that {what} name is already in use here")


async def write_unique(call: Call, query: Any, params: Sequence[Any] | dict[str, Any],
                       taken: Problem) -> psycopg.AsyncCursor[Any]:
    """Run an INSERT/UPDATE that may break a unique name; its 23505 becomes ``taken``."""
    try:
        async with call.conn.transaction():
            return await call.conn.execute(query, params)
    except psycopg.errors.UniqueViolation:
        raise taken from None


def assignments(changes: dict[str, Any]) -> sql.Composable:
    """``col = %s, ...`` for a partial update; values go in ``changes.values()`` order."""
    return sql.SQL(", ").join(sql.SQL("{} = {}").format(sql.Identifier(k), sql.Placeholder())
                              for k in changes)
