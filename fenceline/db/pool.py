"""A small Trio connection pool for `TrioConnection`.

psycopg_pool is asyncio throughout and cannot open under Trio, so fenceline has its own. It is
deliberately small:

- at most ``max_size`` connections, counted by a `trio.Semaphore`; a checkout that cannot get
  one within ``timeout`` seconds raises `PoolTimeout`;
- idle connections are kept in a LIFO stack (the most recently used one is reused first, so
  surplus connections age out), opened lazily on demand, and closed once idle for
  ``max_idle`` seconds;
- a connection idle for more than ``check_after`` seconds, or whose socket has something to
  read (a terminated backend says FATAL before it hangs up), is probed with an empty query
  before it is handed out, and a broken one is replaced transparently;
- the return path (checkin) is shielded and bounded: a connection left in a transaction is
  rolled back, one left busy (ACTIVE), in an unknown state, in pipeline mode or broken is
  discarded. A caller cancelled in the middle of a query can therefore never hand a wedged
  connection to the next one.

Connections are autocommit (see `fenceline.db.connection.connect`): callers group statements
with ``async with conn.transaction():``.
"""

from __future__ import annotations

import logging
import select
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import trio
from psycopg import pq

from fenceline.db.connection import TrioConnection, connect

__all__ = ["Pool", "PoolClosed", "PoolStats", "PoolTimeout", "open_pool"]

logger = logging.getLogger(__name__)

#: Bound on the shielded checkin (rollback of a transaction left open).
CHECKIN_TIMEOUT = 5.0
#: Bound on the health check of a connection that has been idle for a while.
CHECK_TIMEOUT = 5.0

_IDLE = pq.TransactionStatus.IDLE
_INTRANS = pq.TransactionStatus.INTRANS
_INERROR = pq.TransactionStatus.INERROR
_OK = pq.ConnStatus.OK


class PoolTimeout(psycopg.OperationalError):
    """No connection became available within the pool's timeout."""


class PoolClosed(psycopg.OperationalError):
    """The pool has been closed."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool's state and counters since it was created."""

    size: int  # open connections: idle + in use
    idle: int
    in_use: int
    waiting: int  # tasks waiting for a connection right now
    connects: int  # connections opened
    discards: int  # connections closed because broken, dirty, stale or timed out
    timeouts: int  # checkouts that raised PoolTimeout


class Pool:
    """A pool of `TrioConnection` objects. Use `open_pool` or call `close` when done."""

    def __init__(
        self,
        conninfo: str,
        *,
        max_size: int = 10,
        timeout: float = 10.0,
        check_after: float = 30.0,
        max_idle: float = 300.0,
        name: str = "pool",
        connect_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, got {max_size}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.conninfo = conninfo
        self.name = name
        self.max_size = max_size
        self.timeout = timeout
        self.check_after = check_after
        self.max_idle = max_idle
        # Anything TrioConnection.connect takes: row_factory, autocommit, libpq parameters.
        self._connect_kwargs = dict(connect_kwargs or {})
        self._autocommit = bool(self._connect_kwargs.get("autocommit", True))

        self._slots = trio.Semaphore(max_size)
        # (connection, trio.current_time() when it was returned); the right end is the newest.
        self._idle: deque[tuple[TrioConnection[Any], float]] = deque()
        self._in_use = 0
        self._waiting = 0
        self._connects = 0
        self._discards = 0
        self._timeouts = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"<Pool {self.name!r} max_size={self.max_size} {self.statistics()}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> PoolStats:
        return PoolStats(
            size=len(self._idle) + self._in_use,
            idle=len(self._idle),
            in_use=self._in_use,
            waiting=self._waiting,
            connects=self._connects,
            discards=self._discards,
            timeouts=self._timeouts,
        )

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[TrioConnection[Any]]:
        """Check a connection out for the duration of the block.

        Raise `PoolTimeout` if none is free within the pool's ``timeout``. The connection
        goes back to the pool when the block exits, however it exits.
        """
        conn = await self._checkout(self.timeout)
        try:
            yield conn
        finally:
            await self._checkin(conn)

    async def close(self) -> None:
        """Close the idle connections now; connections in use are closed on return."""
        self._closed = True
        while self._idle:
            conn, _ = self._idle.pop()
            await conn.close()

    async def _checkout(self, limit: float) -> TrioConnection[Any]:
        if self._closed:
            raise PoolClosed(f"pool {self.name!r} is closed")
        started = trio.current_time()
        self._waiting += 1
        acquired = False
        try:
            with trio.move_on_after(limit):
                await self._slots.acquire()
                acquired = True
            if not acquired:
                self._timeouts += 1
                raise PoolTimeout(
                    f"pool {self.name!r} (max_size={self.max_size}): no connection free after"
                    f" waiting {trio.current_time() - started:.2f} s; {self._in_use} in use,"
                    f" {self._waiting - 1} other task(s) waiting"
                )
        finally:
            self._waiting -= 1

        self._in_use += 1
        try:
            if self._closed:
                raise PoolClosed(f"pool {self.name!r} is closed")
            return await self._ready_connection()
        except BaseException:
            self._in_use -= 1
            self._slots.release()
            raise

    async def _ready_connection(self) -> TrioConnection[Any]:
        await self._prune()
        now = trio.current_time()
        while self._idle:
            conn, since = self._idle.pop()
            if conn.closed:
                await self._discard(conn, "closed while idle")
                continue
            stale = now - since > self.check_after
            if (stale or _has_input(conn)) and not await self._check(conn):
                continue
            return conn
        new: TrioConnection[Any] = await connect(self.conninfo, **self._connect_kwargs)
        self._connects += 1
        return new

    async def _check(self, conn: TrioConnection[Any]) -> bool:
        """Probe a connection that has been idle for a while; discard it if broken."""
        try:
            with trio.fail_after(CHECK_TIMEOUT):
                await conn.execute("")
        except (psycopg.Error, trio.TooSlowError) as ex:
            await self._discard(conn, f"failed its health check: {ex}")
            return False
        except BaseException:
            # Cancelled while probing: close it rather than leak it (it is in no list now).
            await self._discard(conn, "health check interrupted")
            raise
        return True

    async def _checkin(self, conn: TrioConnection[Any]) -> None:
        try:
            with trio.CancelScope(shield=True):
                reason = None
                with trio.move_on_after(CHECKIN_TIMEOUT) as scope:
                    reason = await self._reset(conn)
                if scope.cancelled_caught:
                    reason = f"checkin did not finish in {CHECKIN_TIMEOUT:g} s"
                if reason is None and self._closed:
                    reason = "pool closed"
                if reason is None:
                    self._idle.append((conn, trio.current_time()))
                else:
                    await self._discard(conn, reason)
        finally:
            self._in_use -= 1
            self._slots.release()

    async def _reset(self, conn: TrioConnection[Any]) -> str | None:
        """Bring a returned connection back to a clean, idle state; else say why not."""
        pgconn = conn.pgconn
        if conn.closed or pgconn.status != _OK:
            return "broken"
        if pgconn.pipeline_status:
            return "left in pipeline mode"
        status = pgconn.transaction_status
        if status in (_INTRANS, _INERROR):
            try:
                await conn.rollback()
            except psycopg.Error as ex:
                return f"rollback failed: {ex}"
            status = pgconn.transaction_status
        if status != _IDLE:
            return f"returned in state {pq.TransactionStatus(status).name}"
        if conn.autocommit != self._autocommit:
            return "autocommit changed"
        return None

    async def _discard(self, conn: TrioConnection[Any], reason: str) -> None:
        self._discards += 1
        logger.debug("pool %r: discarding %s: %s", self.name, conn, reason)
        await conn.close()

    async def _prune(self) -> None:
        """Close connections idle longer than max_idle (the oldest are at the left)."""
        limit = trio.current_time() - self.max_idle
        while self._idle and self._idle[0][1] < limit:
            conn, _ = self._idle.popleft()
            await self._discard(conn, f"idle for more than {self.max_idle:g} s")


def _has_input(conn: TrioConnection[Any]) -> bool:
    """Whether an idle connection's socket is readable: the server said something.

    An idle backend is silent unless it was terminated (FATAL message, then EOF) or sent a
    notification or a parameter change. A zero-timeout poll costs a syscall, not a round trip,
    and lets checkout replace a killed connection before handing it out.
    """
    try:
        fileno = conn.pgconn.socket
    except psycopg.OperationalError:
        return True
    poller = select.poll()
    poller.register(fileno, select.POLLIN)
    return bool(poller.poll(0))


@asynccontextmanager
async def open_pool(
    conninfo: str,
    *,
    max_size: int = 10,
    timeout: float = 10.0,  # noqa: ASYNC109 (the pool's checkout timeout, not this call's)
    check_after: float = 30.0,
    max_idle: float = 300.0,
    name: str = "pool",
    connect_kwargs: Mapping[str, Any] | None = None,
) -> AsyncIterator[Pool]:
    """A `Pool` closed when the block exits."""
    pool = Pool(
        conninfo,
        max_size=max_size,
        timeout=timeout,
        check_after=check_after,
        max_idle=max_idle,
        name=name,
        connect_kwargs=connect_kwargs,
    )
    try:
        yield pool
    finally:
        with trio.CancelScope(shield=True):
            await pool.close()
