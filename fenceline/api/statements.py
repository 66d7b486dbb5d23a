"""Named server-side prepared statements for the API's fixed statements (SQL PREPARE/EXECUTE).

Planning was most of what PostgreSQL spent on a request: the statement of a single-job
submission (the caller, its role, the submission and the audit row) costs about 550 us of
backend CPU sent as text and about 270 us executed from a prepared statement
(docs/DECISIONS.md A8). The driver keeps psycopg's automatic preparation off
(``prepare_threshold=None``, docs/DECISIONS.md P1), so these statements are prepared here
instead, with SQL ``PREPARE``, and run with ``EXECUTE name(values)``: still one
simple-protocol query with the values bound client-side, as every other API statement, so
nothing of psycopg's own prepared-statement state (the part P1 distrusts) is involved, and
no connection is ever put in pipeline mode by it.

- A statement's name is derived from its text (``fl_`` + 16 hex digits of SHA-256), so one
  name always means one text, whichever process or version prepared it.
- What is prepared is remembered per connection object (weakly): a connection the pool
  replaced is a new object and prepares again on first use; one closed is forgotten.
- The first use on a connection sends ``PREPARE`` as a query of its own (once per connection
  and statement); "already exists" (42P05) counts as prepared.
- Only a statement that begins its transaction (sent alone in autocommit, or after the
  request path's ``begin;``) runs prepared; inside a transaction the caller already opened
  (the event stream's re-authorisation) it goes as text, so a forgotten statement can
  always be sent again without losing the caller's work.
- If the server no longer knows a statement we prepared (26000: a connection pooler in
  transaction mode, such as PgBouncer, handed us another server session, or something ran
  ``DEALLOCATE``/``DISCARD``), the connection's record is dropped and the query is sent again
  as plain text. After ``MAX_LOST`` such losses the process stops preparing altogether and
  logs it once: behind PgBouncer in transaction mode every statement goes as text, as before.
  The ``api_prepare`` setting (``--api-prepare off`` / ``FENCELINE_API_PREPARE=off``) does
  that from the start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import weakref
from typing import Any

import psycopg
import psycopg.errors
from psycopg import AsyncClientCursor

log = logging.getLogger("fenceline.api")

#: Statements that vanished from a server session before preparing is switched off.
MAX_LOST = 3

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


class _State:
    enabled = True  # the api_prepare setting (--api-prepare), applied by create_app
    lost = 0


_prepared: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], set[str]] = (
    weakref.WeakKeyDictionary())


def enabled() -> bool:
    return _State.enabled


def set_enabled(value: bool) -> None:
    """Switch preparing on or off for this process (the api_prepare setting; tests)."""
    _State.enabled = value
    _State.lost = 0


class Statement:
    """One fixed statement over named ``%(name)s`` parameters, each with its SQL type.

    ``execute`` runs it prepared when it can, as plain text otherwise; ``prefix`` is SQL sent
    ahead of it in the same query (the request path's ``begin;``).
    """

    def __init__(self, sql: str, types: dict[str, str]) -> None:
        names = list(dict.fromkeys(_PLACEHOLDER.findall(sql)))
        if set(names) != set(types):
            raise ValueError(f"parameters {sorted(names)} but types for {sorted(types)}")
        self.sql = sql
        self.params = names
        self.name = "fl_" + hashlib.sha256(sql.encode()).hexdigest()[:16]
        numbered = _PLACEHOLDER.sub(lambda m: f"${names.index(m.group(1)) + 1}", sql)
        self.prepare_sql = (f"prepare {self.name}({', '.join(types[n] for n in names)})"
                            f" as {numbered}")
        self.execute_sql = (f"execute {self.name}("
                            + ", ".join(f"%({n})s" for n in names) + ")")

    def text(self, conn: psycopg.AsyncConnection[Any], values: dict[str, Any], *,
             prepared: bool) -> str:
        return AsyncClientCursor(conn).mogrify(self.execute_sql if prepared else self.sql,
                                               values)

    async def execute(self, conn: psycopg.AsyncConnection[Any], values: dict[str, Any],
                      prefix: str = "") -> psycopg.AsyncCursor[Any]:
        """The cursor, positioned on this statement's result (after ``prefix``'s).

        Prepared only when no transaction is open yet (the statement or ``prefix`` begins
        it), so that a statement the server forgot can be sent again as text; inside a
        caller's open transaction it goes as text.
        """
        prepared = await self._ready(conn)
        try:
            cur = await conn.execute(prefix + self.text(conn, values, prepared=prepared))
        except psycopg.errors.InvalidSqlStatementName:
            if not prepared:
                raise
            self._lost(conn)
            if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await conn.rollback()   # only what ``prefix`` began
            cur = await conn.execute(prefix + self.text(conn, values, prepared=False))
        if prefix:
            cur.nextset()
        return cur

    async def _ready(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        if (not _State.enabled
                or conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE):
            return False
        done = _prepared.get(conn)
        if done is None:
            done = _prepared[conn] = set()
        if self.name in done:
            return True
        with contextlib.suppress(psycopg.errors.DuplicatePreparedStatement):
            await conn.execute(self.prepare_sql)
        done.add(self.name)
        return True

    def _lost(self, conn: psycopg.AsyncConnection[Any]) -> None:
        _prepared.pop(conn, None)
        _State.lost += 1
        if _State.lost >= MAX_LOST and _State.enabled:
            _State.enabled = False
            log.warning("prepared statements keep vanishing from the server session (a "
                        "connection pooler in transaction mode?); the API sends its "
                        "statements unprepared from now on")
