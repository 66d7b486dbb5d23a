"""The LISTEN fan-out against a real PostgreSQL: delivery, late subscribers, reconnection."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from fenceline.db.connection import TrioConnection, connect
from fenceline.db.listener import RECONNECTED, Listener

Conn = TrioConnection[Any]


@pytest.fixture
async def notifier(dsn: str) -> AsyncIterator[Conn]:
    async with await connect(dsn) as conn:
        yield conn


async def notify(conn: Conn, channel: str, payload: str) -> None:
    await conn.execute("select pg_notify(%s, %s)", (channel, payload))


async def receive(channel: trio.MemoryReceiveChannel[str]) -> str:
    with trio.fail_after(5):
        return await channel.receive()


async def test_fan_out_to_two_subscribers(dsn: str, notifier: Conn, nursery: trio.Nursery) -> None:
    listener = Listener(dsn, name="t")
    with (
        listener.subscribe("jobs") as first,
        listener.subscribe("jobs") as second,
        listener.subscribe("other") as other,
    ):
        await nursery.start(listener.run)
        await notify(notifier, "jobs", "q1")
        await notify(notifier, "jobs", "q2")
        assert [await receive(first), await receive(first)] == ["q1", "q2"]
        assert [await receive(second), await receive(second)] == ["q1", "q2"]
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.WouldBlock):
            other.receive_nowait()
    nursery.cancel_scope.cancel()


async def test_subscribe_while_running_listens_at_once(
    dsn: str, notifier: Conn, nursery: trio.Nursery
) -> None:
    listener = Listener(dsn)
    await nursery.start(listener.run)  # no subscriber yet
    with listener.subscribe("late") as late:
        await listener.wait_listening("late")
        await notify(notifier, "late", "hello")
        assert await receive(late) == "hello"
        # A second new channel on the same live connection.
        with listener.subscribe("later") as later:
            await listener.wait_listening("later")
            await notify(notifier, "later", "again")
            assert await receive(later) == "again"
    nursery.cancel_scope.cancel()


async def test_reconnects_after_backend_terminated(
    dsn: str, notifier: Conn, nursery: trio.Nursery
) -> None:
    listener = Listener(dsn, name="victim", min_backoff=0.01)
    with listener.subscribe("jobs") as first, listener.subscribe("jobs") as second:
        await nursery.start(listener.run)
        await notify(notifier, "jobs", "before")
        assert await receive(first) == "before"
        assert await receive(second) == "before"

        cur = await notifier.execute(
            "select pg_terminate_backend(pid, 5000) from pg_stat_activity"
            " where application_name = 'fenceline victim' and datname = current_database()"
        )
        assert await cur.fetchall() == [(True,)]

        # Both subscribers are told that notifications may have been missed...
        assert await receive(first) == RECONNECTED
        assert await receive(second) == RECONNECTED
        assert listener.reconnects == 1
        # ...and the new connection is listening.
        await notify(notifier, "jobs", "after")
        assert await receive(first) == "after"
        assert await receive(second) == "after"
    nursery.cancel_scope.cancel()


async def test_full_subscriber_drops_without_blocking_others(
    dsn: str, notifier: Conn, nursery: trio.Nursery
) -> None:
    listener = Listener(dsn)
    with listener.subscribe("jobs", buffer=1) as slow, listener.subscribe("jobs") as fast:
        await nursery.start(listener.run)
        for i in range(3):
            await notify(notifier, "jobs", str(i))
        assert [await receive(fast) for _ in range(3)] == ["0", "1", "2"]
        assert await receive(slow) == "0"
        assert listener.dropped == 2
        with pytest.raises(trio.WouldBlock):
            slow.receive_nowait()
    nursery.cancel_scope.cancel()


async def test_leaving_subscriber_gets_nothing_more(
    dsn: str, notifier: Conn, nursery: trio.Nursery
) -> None:
    listener = Listener(dsn)
    with listener.subscribe("jobs") as staying:
        await nursery.start(listener.run)
        with listener.subscribe("jobs") as leaving:
            pass
        with pytest.raises(trio.ClosedResourceError):
            leaving.receive_nowait()
        await notify(notifier, "jobs", "x")
        assert await receive(staying) == "x"
    nursery.cancel_scope.cancel()


async def test_ping_keeps_listening(dsn: str, notifier: Conn, nursery: trio.Nursery) -> None:
    listener = Listener(dsn, ping_interval=0.01)
    with listener.subscribe("jobs") as jobs:
        await nursery.start(listener.run)
        for i in range(5):
            await notify(notifier, "jobs", str(i))
            assert await receive(jobs) == str(i)
    nursery.cancel_scope.cancel()


async def test_unreachable_server_keeps_retrying() -> None:
    listener = Listener("host=127.0.0.1 port=1 dbname=x user=x", min_backoff=0.01)
    with trio.move_on_after(0.3) as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(listener.run)
    assert scope.cancelled_caught  # never started, never crashed


async def test_bad_arguments(dsn: str, nursery: trio.Nursery) -> None:
    listener = Listener(dsn)
    with pytest.raises(ValueError, match="channel"), listener.subscribe(""):
        pass
    with pytest.raises(ValueError, match="channel"), listener.subscribe("x" * 64):
        pass
    with pytest.raises(ValueError, match="buffer"), listener.subscribe("ok", buffer=0):
        pass
    await nursery.start(listener.run)
    with pytest.raises(RuntimeError, match="already running"):
        await listener.run()
    nursery.cancel_scope.cancel()
