"""A Trio-native psycopg 3 connection.

`TrioConnection` is a `psycopg.AsyncConnection` whose socket waits run on
`trio.lowlevel.wait_readable` / `wait_writable`. psycopg's protocol work is done by its
sans-IO generators (`psycopg.generators`); only the code that *waits* is replaced: `connect`,
`wait`, `cancel_safe`, `close` and the connection lock. `TrioCursor` additionally makes
`copy()` safe to cancel. Use `connect()` at the bottom of this module to get one.
"""

# Why the cancellation code looks the way it does: level-triggered vs edge-triggered
# ---------------------------------------------------------------------------------------
#
# psycopg's async layer was written for asyncio, where cancellation is *edge-triggered*:
# `task.cancel()` throws one `CancelledError` into the task, once. After catching it, code may
# await freely: psycopg relies on that everywhere. `AsyncConnection.wait()` catches the error,
# sends a cancel request to the server and drains the query; `AsyncTransaction.__aexit__`
# awaits a ROLLBACK; a pipeline's exit awaits a Sync; `Copy.__aexit__` awaits CopyDone or
# CopyFail; `cursor.stream()` cancels and drains in its `finally`.
#
# Trio's cancellation is *level-triggered*: a cancelled scope stays cancelled, and every
# checkpoint inside it raises `Cancelled` again until the scope is exited. A straight port of
# psycopg's waits therefore skipped every one of those cleanup awaits: ROLLBACK was never sent,
# a cancelled query kept running on the server, and the connection came back INTRANS,
# INERROR, ACTIVE or stuck in pipeline mode. A randomized cancellation fuzz (see
# tests/db/test_cancel_fuzz.py and docs/reference feasibility §1.2) found each of these. The
# rules this module follows, numbered as in that document:
#
# 1. `wait()` catches `trio.Cancelled` while a command is in flight. Inside a shielded scope
#    bounded to 5 s it sends the server-side cancel and drains the generator, then re-raises.
#    If the server does not answer in time the connection is closed. A connection is therefore
#    left IDLE or INERROR (or closed), never ACTIVE with a query running.
# 2. "Cleanup mode": when the task is cancelled *and* an exception is being handled (we are in
#    an `except`, a `finally` or an `__aexit__` running because of that exception), `wait()`,
#    the lock and `cancel_safe()` run shielded with a 10 s deadline. That turns Trio's level
#    back into asyncio's edge for exactly the code that needs it, and nowhere else: a long
#    COPY loop in a cancelled scope must still stop at its next wait.
# 3. The lock is owner-less (an async generator holding it can be finalized by another task)
#    and takes no checkpoint when uncontended: a checkpoint there let `Cancelled` land in
#    `AsyncTransaction.__aexit__` before COMMIT was sent, leaving the connection INTRANS. The
#    socket wait is the cancellation point.
# 4. A read-or-write wait uses a two-task nursery; it re-raises a bare `Cancelled` (or a bare
#    `ClosedResourceError`), never an exception group, so `except trio.Cancelled` works.
# 5. `psycopg.errors._WaitTimeout` subclasses `OperationalError`: catch it first.
# 6. `TrioCursor.copy()` aborts a COPY that a cancellation left half done (CopyFail for COPY
#    FROM, cancel and drain for COPY TO). Upstream psycopg leaves such a connection ACTIVE,
#    on asyncio too.
#
# Three more rules came out of this module's own fuzz runs:
#
# 7. `wait()` never raises `Cancelled` after its generator has completed. psycopg's callers
#    read "wait() raised" as "the operation did not happen": a pipeline `__aenter__` that
#    raised after entering pipeline mode was never exited (psycopg then trips an assert).
#    The cancellation points are the socket waits, plus a `checkpoint_if_cancelled()` before
#    each polled write inside a generator (rule 1 then drains it), so that a COPY or pipeline
#    that never fills the socket still stops. The busy-loop yield after a generator that
#    completed without waiting is `cancel_shielded_checkpoint()`: fairness only.
# 8. In pipeline mode the interrupted generator is drained even when no command is ACTIVE:
#    psycopg's pipeline bookkeeping (queued commands and results, the final Sync) must run to
#    its end. Generators we give up on are closed at once (`_drop`), not by the collector.
# 9. A cancellation that lands on COMMIT is sent to the server by rule 1; a COMMIT cancelled
#    before it started committing leaves the session INERROR with no transaction block left
#    to end it. `TrioConnection.transaction()` rolls such an orphan back (asyncio psycopg
#    has the same hole). As with any cancelled COMMIT, the caller cannot tell whether it
#    committed: that is inherent, not a bug.

from __future__ import annotations

import logging
import math
import select
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast, overload

import psycopg
import trio
from psycopg import errors as e
from psycopg import generators, pq
from psycopg.abc import RV, AdaptContext, ConnParam, Params, PQGen, PQGenConn, Query
from psycopg.adapt import AdaptersMap
from psycopg.conninfo import conninfo_attempts, make_conninfo, timeout_from_conninfo
from psycopg.copy import AsyncCopy, AsyncWriter
from psycopg.rows import AsyncRowFactory, Row, TupleRow, tuple_row
from psycopg.transaction import AsyncTransaction
from psycopg.waiting import Ready, Wait

if TYPE_CHECKING:
    from psycopg.pq.abc import PGconn

__all__ = [
    "CANCEL_TIMEOUT",
    "CLEANUP_TIMEOUT",
    "ConnectionLock",
    "TrioConnection",
    "TrioCursor",
    "connect",
    "trio_wait",
    "trio_wait_conn",
]

logger = logging.getLogger(__name__)

R = TypeVar("R")

#: Bound on the shielded "send a server cancel, then drain the query" step (rule 1).
CANCEL_TIMEOUT = 5.0
#: A cancel request that reaches the server before the backend has started the command is
#: ignored by PostgreSQL; if the command is still running after this long, cancel it again.
RECANCEL_INTERVAL = 0.5
#: Bound on waits, lock acquisitions and cancels that run shielded in cleanup mode (rule 2).
CLEANUP_TIMEOUT = 10.0

# A generator that never blocks (a COPY that only fills libpq's buffer, a pipeline that only
# queues) would otherwise starve the other tasks: yield to the scheduler if we have been busy
# that long without one. Same value and idea as psycopg's waiting.MAX_BUSY_TIME.
_MAX_BUSY_TIME = 0.005
_last_yield = 0.0

_WAIT_R = Wait.R
_WAIT_W = Wait.W
_WAIT_RW = Wait.RW
_READY_R = Ready.R
_READY_W = Ready.W

_IDLE = pq.TransactionStatus.IDLE
_ACTIVE = pq.TransactionStatus.ACTIVE
_INTRANS = pq.TransactionStatus.INTRANS
_INERROR = pq.TransactionStatus.INERROR
_BAD = pq.ConnStatus.BAD
_COPY_IN = pq.ExecStatus.COPY_IN
_COPY_OUT = pq.ExecStatus.COPY_OUT

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_POLL_ERR = select.POLLERR | select.POLLHUP | select.POLLNVAL
_POLL_MASKS: dict[int, int] = {_WAIT_R: _POLLIN, _WAIT_W: _POLLOUT, _WAIT_RW: _POLLIN | _POLLOUT}


_TUPLE_ROW: AsyncRowFactory[Any] = tuple_row


def _cleanup_mode() -> bool:
    """True if we are running cleanup code in a cancelled task (rule 2).

    "Cleanup code" means an exception is being handled: an ``except`` block, a ``finally``
    reached by an exception, an ``__aexit__`` or an async generator's ``aclose()``. In that
    state asyncio would let the awaits through once; Trio would raise ``Cancelled`` at each.
    """
    return sys.exc_info()[1] is not None and (
        trio.current_effective_deadline() <= trio.current_time()
    )


def _cleanup_scope() -> trio.CancelScope:
    return trio.CancelScope(shield=True, deadline=trio.current_time() + CLEANUP_TIMEOUT)


async def _yield_if_busy() -> None:
    """Let other tasks run if we have not yielded to the scheduler for a while.

    Called when a generator has *completed* without blocking, so it must not raise
    `Cancelled`: psycopg's callers assume a `wait()` that raised did not complete. A pipeline's
    ``__aenter__`` that raised after entering pipeline mode, for instance, is never exited
    (the fuzz found exactly that). Cancellation is delivered at the next wait instead.
    """
    global _last_yield
    if time.monotonic() - _last_yield >= _MAX_BUSY_TIME:
        await trio.lowlevel.cancel_shielded_checkpoint()
        _last_yield = time.monotonic()


async def _checkpoint_mid_command() -> None:
    """A cancellation point inside a generator that has not blocked (rule 1 applies).

    Writes are polled, not awaited, so without this a long COPY or pipeline that never fills
    the socket would be impossible to cancel. Also yields to the scheduler when busy.
    """
    global _last_yield
    await trio.lowlevel.checkpoint_if_cancelled()
    if time.monotonic() - _last_yield >= _MAX_BUSY_TIME:
        await trio.lowlevel.checkpoint()
        _last_yield = time.monotonic()


def _ready_now(fileno: int, s: int) -> int:
    """The readiness of ``fileno`` for ``s`` right now (a zero-timeout poll)."""
    p = select.poll()
    p.register(fileno, _POLL_MASKS[s])
    ready = 0
    for _, ev in p.poll(0):
        if ev & _POLLIN:
            ready |= _READY_R
        if ev & _POLLOUT:
            ready |= _READY_W
        if ev & _POLL_ERR:
            # Let libpq find out what is wrong with the socket.
            ready |= s
    return ready


def _drop(gen: PQGen[Any]) -> None:
    """Close a generator we will not resume, now rather than in the garbage collector.

    psycopg's pipeline ``_exit_gen`` yields in a ``finally``: closed by the collector on a
    dead connection it would print an "Exception ignored" traceback.
    """
    try:
        gen.close()
    except Exception as ex:
        logger.debug("error closing an abandoned generator: %s", ex)


def _bare(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf of a group, preferring a real error over ``Cancelled``."""
    cancelled, rest = eg.split(trio.Cancelled)
    group = rest if rest is not None else cancelled
    assert group is not None
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


async def _wait_rw(fileno: int) -> int:
    """Wait until ``fileno`` is readable or writable (rule 4: never raises a group)."""
    ready = 0

    async def wait_one(
        wait: Callable[[int], Awaitable[None]], flag: int, scope: trio.CancelScope
    ) -> None:
        nonlocal ready
        await wait(fileno)
        ready |= flag
        scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            scope = nursery.cancel_scope
            nursery.start_soon(wait_one, trio.lowlevel.wait_readable, _READY_R, scope)
            nursery.start_soon(wait_one, trio.lowlevel.wait_writable, _READY_W, scope)
    except BaseExceptionGroup as eg:
        raise _bare(eg) from None
    return ready


async def _wait_fd(fileno: int, s: int) -> int:
    if s == _WAIT_R:
        await trio.lowlevel.wait_readable(fileno)
        return _READY_R
    if s == _WAIT_W:
        await trio.lowlevel.wait_writable(fileno)
        return _READY_W
    if s == _WAIT_RW:
        return await _wait_rw(fileno)
    raise e.InternalError(f"bad poll status: {s}")


async def _drive(gen: PQGen[RV], s: int, fileno: int, limit: float | None) -> RV:
    """Drive a started generator (whose last yield was ``s``) to completion."""
    if limit is None:
        # The hot path: no cancel scope to enter and leave (a few microseconds per query).
        return await _drive_loop(gen, s, fileno, poll_reads=False)
    with trio.move_on_after(limit):
        # With a time limit, also poll before reading, so that a limit of 0 polls once
        # (as psycopg's timeout=0 does) instead of giving up without looking.
        return await _drive_loop(gen, s, fileno, poll_reads=True)
    # Only the time limit scope above can get here.
    raise e._WaitTimeout("wait timeout expired")


async def _drive_loop(gen: PQGen[RV], s: int, fileno: int, *, poll_reads: bool) -> RV:
    global _last_yield
    try:
        while True:
            # A socket asked for writing is nearly always writable and a zero-timeout poll is
            # much cheaper than a scheduler round trip.
            if (s & _WAIT_W or poll_reads) and (ready := _ready_now(fileno, s)):
                await _checkpoint_mid_command()
                s = gen.send(ready)
                continue
            ready = await _wait_fd(fileno, s)
            _last_yield = time.monotonic()
            s = gen.send(ready)
    except StopIteration as ex:
        return cast(RV, ex.value)
    except (trio.ClosedResourceError, OSError) as ex:
        # ClosedResourceError: close() called notify_closing() on our socket.
        raise e.OperationalError("the connection is closed") from ex


async def trio_wait(gen: PQGen[RV], fileno: int, limit: float | None = None) -> RV:
    """Drive a psycopg generator that waits on ``fileno``: Trio's `waiting.wait_async`.

    Raise `psycopg.errors._WaitTimeout` if ``limit`` (seconds, Trio clock) expires first,
    leaving ``gen`` where it stopped (psycopg's ``timeout`` semantics).
    """
    try:
        s = next(gen)
    except StopIteration as ex:
        await _yield_if_busy()
        return cast(RV, ex.value)
    return await _drive(gen, s, fileno, limit)


async def trio_wait_conn(gen: PQGenConn[RV], limit: float | None = None) -> RV:
    """Drive a psycopg generator that yields ``(fileno, wait)`` pairs (connect, cancel)."""
    try:
        fileno, s = next(gen)
    except StopIteration as ex:
        return cast(RV, ex.value)

    deadline = math.inf if limit is None else trio.current_time() + limit
    with trio.CancelScope(deadline=deadline):
        try:
            while True:
                ready = await _wait_fd(fileno, s)
                fileno, s = gen.send(ready)
        except StopIteration as ex:
            return cast(RV, ex.value)
        except (trio.ClosedResourceError, OSError) as ex:
            raise e.OperationalError("connection socket closed") from ex
    raise e._WaitTimeout("wait timeout expired")


class ConnectionLock:
    """The connection lock: a mutex with no owner and no checkpoint when free (rule 3).

    Owner-less like `asyncio.Lock`: `AsyncConnection.notifies()` is an async generator that
    holds the lock across its yields, and if it is finalized by Trio's async-generator hooks
    the release happens in another task (`trio.Lock` raises there). Waiters are served first
    come, first served: `release()` hands the lock straight to the oldest waiter.
    """

    __slots__ = ("_locked", "_lot")

    def __init__(self) -> None:
        self._locked = False
        self._lot = trio.lowlevel.ParkingLot()

    def locked(self) -> bool:
        return self._locked

    async def acquire(self) -> None:
        if not self._locked:
            self._locked = True
            return
        await self._acquire_contended()

    async def _acquire_contended(self) -> None:
        if not _cleanup_mode():
            await self._lot.park()
            return
        with _cleanup_scope():
            await self._lot.park()
            return
        # The holder kept the connection for CLEANUP_TIMEOUT: give up the cleanup and let the
        # pending Cancelled through.
        logger.warning("connection lock not free after %.0f s of cleanup", CLEANUP_TIMEOUT)
        await trio.lowlevel.checkpoint()
        raise e.OperationalError("timed out waiting for the connection lock during cleanup")

    def release(self) -> None:
        if not self._locked:
            raise RuntimeError("release of an unlocked ConnectionLock")
        if self._lot:
            self._lot.unpark()  # ownership passes to the oldest waiter: stay locked
        else:
            self._locked = False

    async def __aenter__(self) -> None:
        if not self._locked:  # acquire()'s fast path, inlined: this runs on every query
            self._locked = True
            return
        await self._acquire_contended()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.release()


class TrioConnection(psycopg.AsyncConnection[Row]):
    """A `psycopg.AsyncConnection` that runs under Trio. See the module comment."""

    def __init__(
        self,
        pgconn: PGconn,
        row_factory: AsyncRowFactory[Row] = _TUPLE_ROW,
    ):
        super().__init__(pgconn, row_factory)
        # psycopg types the lock as asyncio.Lock; ours has the same async-context interface.
        self.lock = ConnectionLock()  # type: ignore[assignment]
        self.cursor_factory = TrioCursor

    @classmethod
    async def connect(
        cls,
        conninfo: str = "",
        *,
        autocommit: bool = False,
        prepare_threshold: int | None = 5,
        context: AdaptContext | None = None,
        row_factory: AsyncRowFactory[Row] | None = None,
        cursor_factory: type[psycopg.AsyncCursor[Row]] | None = None,
        **kwargs: ConnParam,
    ) -> Self:
        """Connect to a server. Same contract as `psycopg.AsyncConnection.connect`.

        Host names are resolved in a worker thread (psycopg's sync resolver) so that
        ``connect_timeout`` and multiple hosts behave as in psycopg; a Trio cancel scope
        aborts the attempt at any point.
        """
        params = await cls._get_connection_params(conninfo, **kwargs)
        timeout = timeout_from_conninfo(params)
        attempts = await trio.to_thread.run_sync(conninfo_attempts, params, abandon_on_cancel=True)
        rv: Self | None = None
        conn_errors: list[tuple[e.Error, str]] = []
        for attempt in attempts:
            descr = "host: {!r}, port: {!r}, hostaddr: {!r}".format(
                attempt.get("host"), attempt.get("port"), attempt.get("hostaddr")
            )
            try:
                gen = cls._connect_gen(make_conninfo("", **attempt))
                rv = await trio_wait_conn(gen, limit=timeout)
            except e._WaitTimeout:  # rule 5: an OperationalError, so before e.Error
                conn_errors.append((e.ConnectionTimeout("connection timeout expired"), descr))
            except e.Error as ex:
                conn_errors.append((ex, descr))
            else:
                break
            logger.debug("connection attempt failed: %s: %s", descr, conn_errors[-1][0])

        if rv is None:
            last_ex = conn_errors[-1][0]
            if len(conn_errors) == 1:
                raise last_ex.with_traceback(None)
            lines = [str(last_ex), "Multiple connection attempts failed. All failures were:"]
            lines.extend(f"- {descr}: {error}" for error, descr in conn_errors)
            raise type(last_ex)("\n".join(lines), pgconn=last_ex.pgconn).with_traceback(None)

        rv._autocommit = bool(autocommit)
        if row_factory:
            rv.row_factory = row_factory
        if cursor_factory:
            rv.cursor_factory = cursor_factory
        if context:
            rv._adapters = AdaptersMap(context.adapters)
        rv.prepare_threshold = prepare_threshold
        return rv

    async def wait(
        self,
        gen: PQGen[RV],
        interval: float = 0.1,
        timeout: float | None = None,  # noqa: ASYNC109 (psycopg's signature)
    ) -> RV:
        """Consume a generator operating on the connection (psycopg's hook, for Trio).

        ``interval`` is ignored: Trio wakes us on readiness or cancellation, no polling.
        Raise `psycopg.errors._WaitTimeout` if ``timeout`` expires, like psycopg.
        """
        try:
            s = next(gen)
        except StopIteration as ex:
            # Done without waiting (the data was already buffered): the common case for COPY
            # writes, pipeline queueing and stream rows.
            await _yield_if_busy()
            return cast(RV, ex.value)

        if not _cleanup_mode():
            return await self._drive_cancelling(gen, s, timeout)
        with _cleanup_scope():
            return await self._drive_cancelling(gen, s, timeout)
        self._abandon(f"cleanup did not finish in {CLEANUP_TIMEOUT:.0f} s")
        await trio.lowlevel.checkpoint()  # raises the pending Cancelled
        raise e.OperationalError("connection closed: cleanup timed out")

    async def _drive_cancelling(self, gen: PQGen[RV], s: int, limit: float | None) -> RV:
        fileno = self.pgconn.socket
        try:
            return await _drive(gen, s, fileno, limit)
        except (trio.Cancelled, KeyboardInterrupt):
            await self._cancel_in_flight(gen, fileno)
            raise

    async def _cancel_in_flight(self, gen: PQGen[Any], fileno: int) -> None:
        """Rule 1: cancel the interrupted command on the server and drain it, shielded.

        A generator is drained when a command is running (ACTIVE) and also in pipeline mode,
        where psycopg's pipeline bookkeeping (queued commands and results, the Sync of
        ``_exit_gen``) must run to its end or the pipeline can never be exited. Otherwise
        (waiting for notifications, say) there is nothing in flight and it is dropped.
        """
        pgconn = self.pgconn
        active = pgconn.transaction_status == _ACTIVE
        if pgconn.status == _BAD or not (active or pgconn.pipeline_status):
            _drop(gen)
            return
        with trio.CancelScope(shield=True, deadline=trio.current_time() + CANCEL_TIMEOUT) as scope:
            try:
                if active:
                    await self._send_cancel()
                while True:
                    try:
                        await trio_wait(gen, fileno, limit=RECANCEL_INTERVAL if active else None)
                        break
                    except e._WaitTimeout:
                        await self._send_cancel()
            except trio.Cancelled:
                raise  # our own deadline: handled below
            except e.QueryCanceled:
                pass  # as expected
            except e.Error as ex:
                logger.debug("error draining a cancelled command on %s: %s", self, ex)
            except BaseException:  # e.g. KeyboardInterrupt while draining: state unknown
                self._abandon("interrupted while cancelling a command")
                _drop(gen)
                raise
        if scope.cancelled_caught:
            self._abandon(f"query not terminated {CANCEL_TIMEOUT:.0f} s after cancellation")
            _drop(gen)

    async def _send_cancel(self) -> None:
        try:
            await self._cancel_now(limit=CANCEL_TIMEOUT)
        except e.Error as ex:
            # Still drain: the command may end by itself within the time left.
            logger.warning("query cancellation failed on %s: %s", self, ex)

    @asynccontextmanager
    async def transaction(
        self, savepoint_name: str | None = None, force_rollback: bool = False
    ) -> AsyncIterator[AsyncTransaction]:
        """Start a transaction block (see `psycopg.AsyncConnection.transaction`).

        If the block ends with an exception (typically `Cancelled`) and leaves the outermost
        transaction open, roll it back. That happens when a cancellation lands on the COMMIT
        itself: rule 1 cancels it on the server, and a COMMIT cancelled before it started
        committing leaves the session INERROR with no block to end it (asyncio psycopg too).
        """
        entered: AsyncTransaction | None = None
        try:
            async with super().transaction(savepoint_name, force_rollback) as tx:
                entered = tx
                yield tx
        except BaseException:
            if entered is not None and entered._outer_transaction:
                await self._end_orphan_transaction()
            raise

    async def _end_orphan_transaction(self) -> None:
        pgconn = self.pgconn
        if self.closed or self._num_transactions or self._pipeline is not None:
            return
        if pgconn.transaction_status not in (_INTRANS, _INERROR):
            return
        with trio.CancelScope(shield=True, deadline=trio.current_time() + CANCEL_TIMEOUT):
            try:
                await self.rollback()
            except e.Error as ex:
                logger.debug("rollback of an interrupted transaction failed on %s: %s", self, ex)
        if not self.closed and pgconn.transaction_status != _IDLE:
            self._abandon("could not roll back an interrupted transaction")

    async def cancel_safe(self, *, timeout: float = 30.0) -> None:  # noqa: ASYNC109 (psycopg's)
        """Cancel the current operation on the server (libpq >= 17 non-blocking cancel)."""
        if not self._should_cancel():
            return
        if _cleanup_mode():
            with _cleanup_scope():
                await self._cancel_now(limit=timeout)
            return
        await self._cancel_now(limit=timeout)

    async def _cancel_now(self, *, limit: float | None) -> None:
        if psycopg.capabilities.has_cancel_safe():
            try:
                await trio_wait_conn(self._cancel_gen(), limit=limit or None)
            except e._WaitTimeout:
                raise e.CancellationTimeout("cancellation timeout expired") from None
        else:
            await trio.to_thread.run_sync(self.cancel, abandon_on_cancel=True)

    async def close(self) -> None:
        """Close the connection, waking any task blocked on its socket (e.g. in notifies())."""
        if self.closed:
            return
        self._closed = True
        self._finish()

    def _abandon(self, why: str) -> None:
        logger.warning("%s: closing connection %s", why, self)
        self._finish()

    def _finish(self) -> None:
        try:
            fileno = self.pgconn.socket
        except e.OperationalError:
            fileno = -1
        if fileno >= 0:
            # Wake the tasks waiting on the socket before the fd number can be reused.
            trio.lowlevel.notify_closing(fileno)
        self.pgconn.finish()


class TrioCursor(psycopg.AsyncCursor[Row]):
    """`psycopg.AsyncCursor` whose `copy()` never leaves the connection inside a COPY."""

    __slots__ = ()

    @asynccontextmanager
    async def copy(
        self,
        statement: Query,
        params: Params | None = None,
        *,
        writer: AsyncWriter | None = None,
    ) -> AsyncIterator[AsyncCopy]:
        """Start a COPY and return an object to manage it (see `psycopg.AsyncCursor.copy`).

        Rule 6: if the block is cancelled or fails at a point where psycopg leaves the COPY
        open (after the server accepted it but before the `AsyncCopy` exists, or while
        `AsyncCopy.__aexit__` flushes the last buffer), the COPY is ended here: CopyFail for
        COPY FROM, a server cancel plus drain for COPY TO. The same applies if the block
        leaves a COPY TO unread.
        """
        conn = self.connection
        async with conn.lock:
            try:
                await conn.wait(self._start_copy_gen(statement, params))
            except BaseException:
                await self._abort_copy()
                raise
            try:
                async with AsyncCopy(self, writer=writer) as copy:
                    yield copy
            finally:
                await self._abort_copy()

        # As psycopg: read the rowcount the Copy object left on the cursor.
        self._select_current_result(0)

    async def _abort_copy(self) -> None:
        """End a COPY that is still open on the connection; close the connection if stuck."""
        pgconn = self._pgconn
        if pgconn.status == _BAD or pgconn.transaction_status != _ACTIVE:
            return
        result = self.pgresult
        direction = result.status if result else None
        conn = self.connection
        with trio.CancelScope(shield=True, deadline=trio.current_time() + CANCEL_TIMEOUT) as scope:
            try:
                if direction == _COPY_IN:
                    await conn.wait(generators.copy_end(pgconn, b"COPY aborted by the client"))
                elif direction == _COPY_OUT:
                    await conn.cancel_safe(timeout=CANCEL_TIMEOUT)
                    await conn.wait(_drain_copy_out(pgconn))
            except trio.Cancelled:
                raise
            except e.Error as ex:  # QueryCanceled is the expected outcome
                logger.debug("COPY aborted on %s: %s", conn, ex)
        if scope.cancelled_caught or (
            pgconn.status != _BAD and pgconn.transaction_status == _ACTIVE
        ):
            if isinstance(conn, TrioConnection):
                conn._abandon("could not end an interrupted COPY")
            else:
                pgconn.finish()


def _drain_copy_out(pgconn: PGconn) -> PQGen[None]:
    """Read and drop the rest of a COPY TO, up to its final result."""
    while isinstance((yield from generators.copy_from(pgconn)), memoryview):
        pass


@overload
async def connect(
    conninfo: str = "",
    *,
    row_factory: AsyncRowFactory[R],
    autocommit: bool = True,
    prepare_threshold: int | None = None,
    **kwargs: Any,
) -> TrioConnection[R]: ...


@overload
async def connect(
    conninfo: str = "",
    *,
    autocommit: bool = True,
    prepare_threshold: int | None = None,
    **kwargs: Any,
) -> TrioConnection[TupleRow]: ...


async def connect(
    conninfo: str = "",
    *,
    autocommit: bool = True,
    prepare_threshold: int | None = None,
    **kwargs: Any,
) -> TrioConnection[Any]:
    """Open a `TrioConnection` with fenceline's defaults.

    ``autocommit=True``: use ``conn.transaction()`` blocks for transactions.
    ``prepare_threshold=None``: no auto-prepared statements. A cancelled pipeline with
    auto-prepared statements poisons the connection in psycopg 3.3 (on asyncio too), and
    PgBouncer in transaction mode cannot use them either.
    Other keyword arguments go to `TrioConnection.connect` (``row_factory``, ``context``,
    libpq parameters such as ``application_name`` or ``connect_timeout``).
    """
    conn: TrioConnection[Any] = await TrioConnection.connect(
        conninfo, autocommit=autocommit, prepare_threshold=prepare_threshold, **kwargs
    )
    return conn
