"""A dedicated connection that comes back after it is lost.

The worker keeps its handlers running while the database is away: a claim, a report or a
heartbeat that fails because the connection broke waits, reconnects with capped backoff
and tries again with the same arguments. Retrying is safe because every worker write names
the fence it holds: if the job moved on meanwhile, the retry is refused as ``fenced`` and
changes nothing. Errors that are not about the connection (bad input, a bug) are raised.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import trio

from fenceline.db.connection import TrioConnection, connect

log = logging.getLogger("fenceline.worker")

T = TypeVar("T")

BACKOFF_INITIAL = 0.1
BACKOFF_CAP = 5.0
CONNECT_TIMEOUT = 10.0


class Link:
    def __init__(self, dsn: str, name: str) -> None:
        self.dsn = dsn
        self.name = name
        self._conn: TrioConnection[Any] | None = None
        self._connecting = trio.Lock()  # several tasks share a link: connect once
        self.reconnects = 0

    async def _connection(self) -> TrioConnection[Any]:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        async with self._connecting:
            return await self._reconnect()

    async def _reconnect(self) -> TrioConnection[Any]:
        delay = BACKOFF_INITIAL
        while self._conn is None or self._conn.closed:
            try:
                with trio.fail_after(CONNECT_TIMEOUT):
                    self._conn = await connect(
                        self.dsn, application_name=f"fenceline worker {self.name}")
            except (psycopg.OperationalError, trio.TooSlowError, OSError) as exc:
                log.warning("worker connection unavailable; retrying",
                            extra={"link": self.name, "error": str(exc).strip()[:200],
                                   "retry_in_s": delay})
                await trio.sleep(delay)
                delay = min(BACKOFF_CAP, delay * 2)
        return self._conn

    async def call(self, fn: Callable[[TrioConnection[Any]], Awaitable[T]]) -> T:
        """Run ``fn(conn)``; on a lost connection reconnect and run it again."""
        while True:
            conn = await self._connection()
            try:
                return await fn(conn)
            except psycopg.OperationalError:
                if not conn.broken and not conn.closed:
                    raise
                if self._conn is conn:
                    log.warning("worker connection lost; reconnecting",
                                extra={"link": self.name})
                    self.reconnects += 1
                    self._conn = None
                with trio.CancelScope(shield=True):
                    await conn.close()

    async def aclose(self) -> None:
        if self._conn is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self._conn.close()
            self._conn = None
