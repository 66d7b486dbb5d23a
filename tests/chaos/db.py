"""The orchestrator's own connections: they must outlive backend kills and server restarts.

``Db.rows`` runs one statement; when the connection is gone (the server restarting, the
backend terminated) it raises ``DbDown`` and the next call connects afresh. ``Db.retry``
keeps trying for a while, for the writes a fault or a check must make. Connections are named
``chaos orchestrator`` so the backend-killing fault can leave them alone.
"""

from __future__ import annotations

from typing import Any

import psycopg
import trio

from fenceline.db.connection import TrioConnection, connect

APPLICATION_NAME = "chaos orchestrator"
# A statement of the orchestrator may take this long; past it, the connection is dropped.
STATEMENT_TIMEOUT = 15.0


class DbDown(Exception):
    """The statement did not run (or its outcome is unknown): the connection was lost."""


class Db:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: TrioConnection[Any] | None = None
        self._lock = trio.Lock()
        self.reconnects = 0

    async def rows(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        async with self._lock:
            try:
                with trio.fail_after(STATEMENT_TIMEOUT):
                    if self._conn is None or self._conn.closed or self._conn.broken:
                        await self._drop()
                        self._conn = await connect(self.dsn, application_name=APPLICATION_NAME,
                                                   connect_timeout=5)
                        self.reconnects += 1
                    cur = await self._conn.execute(query.encode(), params)
                    return await cur.fetchall() if cur.description is not None else []
            except (psycopg.OperationalError, OSError, trio.TooSlowError) as exc:
                await self._drop()
                raise DbDown(str(exc).strip() or type(exc).__name__) from exc

    async def val(self, query: str, params: Any = None) -> Any:
        found = await self.rows(query, params)
        return found[0][0] if found else None

    async def retry(self, query: str, params: Any = None, *,
                    within: float = 60.0) -> list[tuple[Any, ...]]:
        """``rows``, retried every 0.2 s while the server is unreachable, up to ``within`` s."""
        deadline = trio.current_time() + within
        while True:
            try:
                return await self.rows(query, params)
            except DbDown:
                if trio.current_time() > deadline:
                    raise
                await trio.sleep(0.2)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await conn.close()

    async def aclose(self) -> None:
        await self._drop()
