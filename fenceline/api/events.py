"""The event stream over HTTP: a project's outbox (``fl.events``), oldest first, by cursor.

**The cursor is a position, not an id.** Event ids are assigned at insert, so a later id can
commit first. A reader that follows ``(txid, id)`` and reads only rows whose writing
transaction is below ``pg_snapshot_xmin(pg_current_snapshot())`` never skips a late commit:
every transaction below that xmin has finished, and one transaction's events are contiguous
in that order (docs/SCHEMA.md section 5). The cost: an event becomes readable only once every
transaction that was *writing* when it committed has finished, so one long writing
transaction anywhere on the server (even in another database) delays the stream; it never
loses events. Read-only transactions do not hold it back.

Clients see the position as an opaque string (base64url of ``[txid, id]``); ``next`` is the
position of the last event returned, or the one given when nothing is new. ``after`` absent
starts at the oldest retained event, ``after=tail`` at the current end (reference W11: no
need to know the low-water mark to start).

**Hot paths write one event for many jobs** (claim, complete, release, promote, bulk replay
list them in ``payload.jobs``). They are passed through as written, one event each; a client
that wants one entry per job expands ``payload.jobs`` itself.

**Retention.** The scheduler's ``events-retention`` sweep (``fl.prune_events``,
migrations/0013_events_retention.sql; ``--events-retention-days``, default 7) deletes old
events, only below the xmin above, and records per project the last position it dropped in
``fl.events_retention`` in the same transaction (migrations/0008_events.sql). A cursor below
that position answers 410 ``cursor_too_old`` with ``oldest``, a cursor to resume from
(reference W11: the 410 is machine-readable).
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

from fenceline.api.endpoint import Call, Reply, Resource
from fenceline.api.problems import Problem
from fenceline.api.validation import (
    INT64_MAX,
    any_json,
    array,
    integer,
    obj,
    string,
    timestamp,
    uuid_string,
)

resource = Resource("events", "Events")

DEFAULT_LIMIT = 50
MAX_LIMIT = 100
TAIL = "tail"
_MAX_XID8 = 2**64 - 1


@dataclass(frozen=True, order=True)
class Position:
    """Where a reader is in a project's outbox: after the event ``(txid, id)``."""

    txid: int
    id: int

    def encode(self) -> str:
        raw = json.dumps([self.txid, self.id], separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


START = Position(0, 0)


def invalid_cursor(detail: str = "after must be a cursor this API gave out, or 'tail'",
                   ) -> Problem:
    return Problem(400, "invalid_cursor", "Invalid cursor", detail, field="after")


def decode(raw: str) -> Position:
    """The position ``raw`` names; 400 ``invalid_cursor`` for anything ``encode`` did not make."""
    if not raw or len(raw) > 100 or not raw.isascii():
        raise invalid_cursor()
    try:
        value = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError, RecursionError):
        raise invalid_cursor() from None
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) is int for v in value)
            or not 0 <= value[0] <= _MAX_XID8 or not 0 <= value[1] <= INT64_MAX):
        raise invalid_cursor()
    return Position(value[0], value[1])


class CursorTooOld(Problem):
    """Retention dropped events after the cursor; ``oldest`` is where to resume."""

    def __init__(self, oldest: Position) -> None:
        super().__init__(410, "cursor_too_old", "Cursor too old",
                         "events after this cursor have been dropped by retention; resume "
                         "from oldest (you missed events)", oldest=oldest.encode())
        self.oldest = oldest


EVENT = obj({
    "id": integer(1, INT64_MAX),
    "topic": string(description="For example job.submitted, jobs.claimed; see docs/SCHEMA.md."),
    "queue_id": uuid_string(nullable=True),
    "job_id": integer(1, INT64_MAX, nullable=True),
    "payload": any_json("As written by the engine. Events of hot paths list many jobs in "
                        "payload.jobs; they are passed through as one event."),
    "created_at": timestamp(),
}, ["id", "topic", "queue_id", "job_id", "payload", "created_at"])

_COLUMNS = ("id", "topic", "queue_id", "job_id", "payload", "created_at")


@dataclass
class Page:
    events: list[dict[str, Any]]
    next: Position
    # Committed events after ``next`` wait for an older transaction to end: ask again soon
    # (no notification will say when). Always False for a full page (ask again at once).
    pending: bool = False


async def tail(conn: psycopg.AsyncConnection[Any]) -> Position:
    """The current end: every event committed from now on comes after it."""
    cur = await conn.execute("select pg_snapshot_xmin(pg_current_snapshot())::text")
    row = await cur.fetchone()
    assert row is not None
    return Position(int(row[0]), 0)


async def low_water(conn: psycopg.AsyncConnection[Any], project_id: uuid.UUID,
                    ) -> Position | None:
    """The last position retention dropped in this project, if it dropped any."""
    cur = await conn.execute(
        "select txid::text, id from fl.events_retention where project_id = %s", (project_id,))
    row = await cur.fetchone()
    return None if row is None else Position(int(row[0]), row[1])


async def read(conn: psycopg.AsyncConnection[Any], project_id: uuid.UUID, after: Position,
               limit: int) -> Page:
    """Up to ``limit`` events after ``after``, in (txid, id) order, none that could be passed
    by a later commit; then 410 if retention dropped any of them.

    The events are read before the low-water mark: a retention pass that commits in between
    makes this answer 410 (the client resumes from ``oldest``) rather than skip events.
    """
    # xmin comes from the statement's own snapshot (pg_current_snapshot is the active one), so
    # every row with a txid below it that this statement could ever see, it sees.
    cur = await conn.execute(
        "select e.id, e.topic, e.queue_id, e.job_id, e.payload, e.created_at, e.txid::text"
        "  from fl.events e"
        " where e.project_id = %(project)s"
        "   and (e.txid, e.id) > (%(txid)s::xid8, %(id)s)"
        "   and e.txid < pg_snapshot_xmin(pg_current_snapshot())"
        " order by e.txid, e.id"
        " limit %(limit)s",
        {"project": project_id, "txid": str(after.txid), "id": after.id, "limit": limit})
    rows = await cur.fetchall()
    oldest = await low_water(conn, project_id)
    if oldest is not None and after < oldest:
        raise CursorTooOld(oldest)
    events = [dict(zip(_COLUMNS, row[:6], strict=True)) for row in rows]
    end = Position(int(rows[-1][6]), rows[-1][0]) if rows else after
    pending = False
    if len(rows) < limit:
        cur = await conn.execute(
            "select exists (select from fl.events e where e.project_id = %s"
            "                  and (e.txid, e.id) > (%s::xid8, %s))",
            (project_id, str(end.txid), end.id))
        row = await cur.fetchone()
        pending = bool(row and row[0])
    return Page(events, end, pending)


async def start(conn: psycopg.AsyncConnection[Any], project_id: uuid.UUID,
                raw: str | None) -> Position:
    """Where a reader given ``after=raw`` starts (None: the oldest retained event)."""
    if raw == TAIL:
        return await tail(conn)
    if raw is None:
        return await low_water(conn, project_id) or START
    return decode(raw)


@resource.route(
    "GET", "/projects/{project_id}/events",
    summary="A project's events, oldest first, after a cursor",
    role="viewer", scope=("project", "project_id"),
    query={"after": string(1, 100, description="next of the previous answer; 'tail' starts "
                                               "at the current end; absent: the oldest "
                                               "retained event."),
           "limit": integer(1, MAX_LIMIT, description=f"1-{MAX_LIMIT}; default "
                                                      f"{DEFAULT_LIMIT}.")},
    responses={200: obj({"items": array(EVENT),
                         "next": string(description="Pass as after; unchanged when nothing "
                                                    "is new.")},
                        ["items", "next"])},
    problems=(410,))
async def list_events(call: Call) -> Reply:
    project_id = call.params["project_id"]
    raw = call.query.get("after")
    after = await start(call.conn, project_id, raw)
    limit: int = call.query.get("limit", DEFAULT_LIMIT)
    while True:
        try:
            page = await read(call.conn, project_id, after, limit)
        except CursorTooOld as exc:
            if raw is not None:
                raise
            # "From the oldest" started at a low-water mark that a retention pass has
            # moved since: the client asked for the oldest retained event, so follow it.
            after = exc.oldest
            continue
        return Reply(200, {"items": page.events, "next": page.next.encode()})
