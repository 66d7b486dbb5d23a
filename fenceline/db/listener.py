"""One LISTEN connection per process, fanned out to in-process subscribers.

A `Listener` owns a dedicated `TrioConnection`, LISTENs on every channel that has a
subscriber, and forwards each notification's payload to the subscribers of its channel over
Trio memory channels::

    listener = Listener(dsn)
    await nursery.start(listener.run)           # returns once LISTEN is active
    with listener.subscribe("fl_jobs") as wakeups:
        async for payload in wakeups:
            ...                                 # then poll the database

Notifications are *wake-ups, not messages*. PostgreSQL drops them while nobody listens (for
instance while this process reconnects), and a subscriber that falls behind has them dropped
here: when a subscriber's buffer is full the fan-out drops the payload for that subscriber
rather than block every other one. So every subscriber must have a poll behind it: on any
wake-up, and also on a timer, it reads the real state from the database. After a
reconnection every subscriber receives the synthetic payload `RECONNECTED`, because
notifications may have been missed while the connection was down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import aclosing, contextmanager
from typing import Any, Final

import psycopg
import trio
from psycopg import sql

from fenceline.db.connection import TrioConnection, connect

__all__ = ["RECONNECTED", "Listener"]

logger = logging.getLogger(__name__)

#: Payload sent to every subscriber after the listener reconnected. PostgreSQL text cannot
#: contain NUL, so no real notification payload can be equal to it.
RECONNECTED: Final = "\x00reconnected"

# PostgreSQL truncates identifiers longer than NAMEDATALEN - 1 bytes: LISTEN would listen on
# the truncated name and we would never match its notifications.
_MAX_CHANNEL_BYTES = 63

# TCP keepalives so that a silently dead network is noticed; ignored on unix sockets.
_KEEPALIVES: Mapping[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


class Listener:
    """Fan PostgreSQL notifications out to in-process subscribers. See the module doc."""

    def __init__(
        self,
        conninfo: str,
        *,
        name: str = "listener",
        min_backoff: float = 0.1,
        max_backoff: float = 10.0,
        ping_interval: float = 60.0,
        ping_timeout: float = 10.0,
        connect_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.name = name
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        # How often the idle connection is probed, and how long the probe may take: catches a
        # dead peer faster than TCP would.
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self._connect_kwargs = {
            "application_name": f"fenceline {name}",
            **_KEEPALIVES,
            **(connect_kwargs or {}),
        }
        # channel -> the send ends of its subscribers (dict: ordered, identity-keyed)
        self._subscribers: dict[str, dict[trio.MemorySendChannel[str], None]] = {}
        self._listening: set[str] = set()  # channels LISTENed on the current connection
        self._listening_changed = trio.Event()
        self._wait_scope: trio.CancelScope | None = None  # set while blocked in notifies()
        self._running = False
        self.reconnects = 0  # connections lost and re-established
        self.dropped = 0  # payloads dropped because a subscriber's buffer was full

    def __repr__(self) -> str:
        return f"<Listener {self.name!r} channels={sorted(self._subscribers)}>"

    @contextmanager
    def subscribe(
        self, channel: str, *, buffer: int = 64
    ) -> Iterator[trio.MemoryReceiveChannel[str]]:
        """Receive the payloads notified on ``channel`` while the block runs.

        The channel holds at most ``buffer`` undelivered payloads; more are dropped for this
        subscriber (see the module doc: always poll behind a wake-up). If the listener is
        running, LISTEN is issued on its connection at once; `wait_listening` waits for it.
        """
        if not channel or len(channel.encode()) > _MAX_CHANNEL_BYTES:
            raise ValueError(f"channel name must be 1 to {_MAX_CHANNEL_BYTES} bytes: {channel!r}")
        if buffer < 1:
            raise ValueError(f"buffer must be at least 1, got {buffer}")
        send, receive = trio.open_memory_channel[str](buffer)
        self._subscribers.setdefault(channel, {})[send] = None
        if channel not in self._listening and self._wait_scope is not None:
            self._wait_scope.cancel()  # interrupt notifies() so that run() issues LISTEN
        try:
            with receive:
                yield receive
        finally:
            send.close()
            subscribers = self._subscribers.get(channel, {})
            subscribers.pop(send, None)
            if not subscribers:
                # Keep LISTENing: harmless, and a new subscriber needs no round trip.
                self._subscribers.pop(channel, None)

    async def wait_listening(self, channel: str) -> None:
        """Return once LISTEN ``channel`` is active on the listener's connection."""
        while channel not in self._listening:
            await self._listening_changed.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled, reconnecting with capped backoff when the connection drops.

        ``task_status.started()`` is called once the first connection is listening.
        """
        if self._running:
            raise RuntimeError(f"listener {self.name!r} is already running")
        self._running = True
        backoff = self.min_backoff
        connected_before = False
        try:
            while True:
                try:
                    conn = await connect(self.conninfo, **self._connect_kwargs)
                except psycopg.OperationalError as ex:
                    logger.warning(
                        "listener %r cannot connect (retrying in %.1f s): %s",
                        self.name,
                        backoff,
                        ex,
                    )
                else:
                    try:
                        await self._sync_listens(conn)
                        backoff = self.min_backoff
                        if connected_before:
                            self.reconnects += 1
                            logger.info("listener %r reconnected", self.name)
                            self._broadcast(RECONNECTED)
                        else:
                            connected_before = True
                            task_status.started()
                        await self._pump(conn)
                    except psycopg.OperationalError as ex:
                        logger.warning(
                            "listener %r lost its connection (reconnecting in %.1f s): %s",
                            self.name,
                            backoff,
                            ex,
                        )
                    finally:
                        self._set_listening(set())
                        with trio.CancelScope(shield=True):
                            await conn.close()
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
        finally:
            self._running = False

    async def _pump(self, conn: TrioConnection[Any]) -> None:
        """Forward notifications until the connection fails (raises OperationalError)."""
        while True:
            await self._sync_listens(conn)
            with trio.CancelScope() as scope:
                # No checkpoint between the check in _sync_listens and here, so a subscribe()
                # for a new channel either was seen there or finds this scope to cancel.
                self._wait_scope = scope
                try:
                    async with aclosing(conn.notifies(timeout=self.ping_interval)) as notifies:
                        async for notify in notifies:
                            self._dispatch(notify.channel, notify.payload)
                finally:
                    self._wait_scope = None
            if not scope.cancelled_caught:
                await self._ping(conn)

    async def _ping(self, conn: TrioConnection[Any]) -> None:
        with trio.move_on_after(self.ping_timeout) as scope:
            await conn.execute("")
        if scope.cancelled_caught:
            raise psycopg.OperationalError(f"no answer to a ping in {self.ping_timeout:g} s")

    async def _sync_listens(self, conn: TrioConnection[Any]) -> None:
        """LISTEN on every subscribed channel not listened to yet on ``conn``."""
        while missing := [c for c in self._subscribers if c not in self._listening]:
            query = sql.SQL("; ").join(
                sql.SQL("LISTEN {}").format(sql.Identifier(c)) for c in missing
            )
            await conn.execute(query)
            self._set_listening(self._listening | set(missing))

    def _set_listening(self, channels: set[str]) -> None:
        self._listening = channels
        self._listening_changed.set()
        self._listening_changed = trio.Event()

    def _dispatch(self, channel: str, payload: str) -> None:
        for send in list(self._subscribers.get(channel, ())):
            try:
                send.send_nowait(payload)
            except trio.WouldBlock:
                self.dropped += 1
                logger.debug("listener %r: subscriber of %r is full, dropped", self.name, channel)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the subscriber is leaving

    def _broadcast(self, payload: str) -> None:
        for channel in list(self._subscribers):
            self._dispatch(channel, payload)
