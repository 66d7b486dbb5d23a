"""The event websocket on a real hypercorn server, driven by trio-websocket.

Time in these tests is the server's own wall clock (poll cycles, heartbeats), so the server
runs with short timings; nothing here sleeps to make database time pass.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio
from hypercorn.trio import serve as hypercorn_serve
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, RejectConnection, RejectData, Request

from fenceline.api.app import create_app
from fenceline.api.events import Position
from fenceline.api.server import hypercorn_config
from fenceline.api.stream import Hub, StreamTiming, origin_allowed
from fenceline.config import Settings
from fenceline.db.pool import Pool
from fenceline.readiness import Readiness
from tests.api.conftest import Api, Tenant

TIMING = StreamTiming(poll=0.25, heartbeat=0.6, send_timeout=2.0)
WAIT = 20.0   # another test's open transaction can hold the readable horizon back a while


@dataclass
class Server:
    host: str       # 127.0.0.1:port
    hub: Hub

    def url(self, project: Any, after: str | None = None, **query: str) -> str:
        params = ({"after": after} if after is not None else {}) | query
        tail = "&".join(f"{k}={v}" for k, v in params.items())
        return (f"ws://{self.host}/api/v1/projects/{project}/events/stream"
                + (f"?{tail}" if tail else ""))


@pytest.fixture
async def server(pool: Pool, nursery: trio.Nursery) -> AsyncIterator[Server]:
    settings = Settings(api_addr="127.0.0.1", api_port=0, password_profile="minimal")
    app = create_app(Readiness(pool=pool, reason=None), settings)
    app.config["FENCELINE_STREAM_TIMING"] = TIMING
    shutdown = trio.Event()
    binds = await nursery.start(partial(hypercorn_serve, app, hypercorn_config(settings),
                                        shutdown_trigger=shutdown.wait))
    yield Server(binds[0].removeprefix("http://"), app.config["FENCELINE_STREAM_HUB"])
    shutdown.set()


def protocols(token: str) -> list[str]:
    return ["fl.v1", f"fl.token.{token}"]


async def frame(ws: WebSocketConnection, *, pings: bool = False) -> dict[str, Any]:
    """The next frame, heartbeats skipped unless asked for."""
    with trio.fail_after(WAIT):
        while True:
            decoded: dict[str, Any] = json.loads(await ws.get_message())
            if pings or decoded["type"] != "ping":
                return decoded


async def collect(ws: WebSocketConnection, count: int, prev: str) -> tuple[list[Any], str]:
    """Batches until ``count`` events came; each frame's prev must be the last next."""
    got: list[Any] = []
    while len(got) < count:
        batch = await frame(ws)
        assert batch["type"] == "batch", batch
        assert batch["prev"] == prev, "gap: prev is not the previous next"
        assert batch["events"] and len(batch["events"]) <= 1000
        got += batch["events"]
        prev = batch["next"]
    return got, prev


async def closed(ws: WebSocketConnection) -> tuple[int, str | None, float]:
    """Read until the server closes; (code, reason, seconds it took)."""
    began = trio.current_time()
    try:
        with trio.fail_after(WAIT):
            while True:
                await ws.get_message()
    except ConnectionClosed as exc:
        reason = exc.reason
    finally:
        # trio-websocket 0.12 does not close its socket when the server closed first.
        await ws._stream.aclose()
    return reason.code, reason.reason, trio.current_time() - began


async def until(done: Callable[[], bool]) -> None:
    """Wait for the server to get somewhere (its own clock, not the database's)."""
    with trio.fail_after(WAIT):
        for _ in itertools.count():
            if done():
                return
            await trio.sleep(0.01)


async def rejected(url: str, subprotocols: list[str] | None = None,
                   extra_headers: list[tuple[bytes, bytes]] | None = None,
                   ) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Ask for an upgrade that must be refused; (status, problem, headers).

    Spoken with wsproto directly: trio-websocket 0.12 leaves the socket of a refused
    handshake open.
    """
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    client = WSConnection(ConnectionType.CLIENT)
    status, headers, body = 0, {}, b""
    async with await trio.open_tcp_stream(parts.hostname, parts.port) as sock:
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        await sock.send_all(client.send(Request(
            host=parts.netloc, target=target, subprotocols=subprotocols or [],
            extra_headers=extra_headers or [])))
        with trio.fail_after(WAIT):
            done = False
            while not done:
                client.receive_data(await sock.receive_some() or None)
                for event in client.events():
                    assert not isinstance(event, AcceptConnection), "the upgrade was accepted"
                    if isinstance(event, RejectConnection):
                        status = event.status_code
                        headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                        done = not event.has_body
                    elif isinstance(event, RejectData):
                        body += event.data
                        done = event.body_finished
    assert headers["content-type"] == "application/problem+json"
    return status, json.loads(body), headers


async def submit(api: Api, queue: uuid.UUID) -> int:
    [(job,)] = await api.sql("select job_id from fl.submit(%s, 't', '{}')", queue)
    return int(job)


async def order(api: Api, project: uuid.UUID) -> list[int]:
    rows = await api.sql("select id from fl.events where project_id = %s order by txid, id",
                         project)
    return [r[0] for r in rows]


async def test_replay_then_live_in_one_unbroken_chain(api: Api, tenant: Tenant,
                                                      server: Server) -> None:
    token = tenant.tokens["viewer"]
    before = [await submit(api, tenant.queue_id) for _ in range(3)]
    async with open_websocket_url(server.url(tenant.project_id),
                                  subprotocols=protocols(token)) as ws:
        assert ws.subprotocol == "fl.v1"
        assert all(token not in v.decode() for _, v in ws.handshake_headers)
        ready = await frame(ws)
        assert ready == {"type": "ready", "cursor": Position(0, 0).encode()}
        replayed, cursor = await collect(ws, 3, ready["cursor"])
        assert [e["job_id"] for e in replayed] == before
        live_jobs = [await submit(api, tenant.queue_id) for _ in range(2)]
        live, _ = await collect(ws, 2, cursor)
        assert [e["job_id"] for e in live] == live_jobs
        assert [e["id"] for e in replayed + live] == await order(api, tenant.project_id)
        assert set(live[0]) == {"id", "topic", "queue_id", "job_id", "payload", "created_at"}
        assert server.hub.open == {f"user:{tenant.users['viewer']}": 1}
    await until(lambda: not server.hub.open)


async def test_resume_after_a_cursor_and_from_the_tail(api: Api, tenant: Tenant,
                                                       server: Server) -> None:
    token = tenant.tokens["viewer"]
    jobs = [await submit(api, tenant.queue_id) for _ in range(3)]
    async with open_websocket_url(server.url(tenant.project_id),
                                  subprotocols=protocols(token)) as ws:
        ready = await frame(ws)
        first = await frame(ws)
        assert first["prev"] == ready["cursor"]
    # Resume from a position inside that batch: the cursor of the first event.
    rows = await api.sql("select txid::text, id from fl.events where job_id = %s", jobs[0])
    after = Position(int(rows[0][0]), rows[0][1]).encode()
    async with open_websocket_url(server.url(tenant.project_id, after),
                                  subprotocols=protocols(token)) as ws:
        ready = await frame(ws)
        assert ready["cursor"] == after
        rest, _ = await collect(ws, 2, after)
        assert [e["job_id"] for e in rest] == jobs[1:]
    async with open_websocket_url(server.url(tenant.project_id, "tail"),
                                  subprotocols=protocols(token)) as ws:
        ready = await frame(ws)
        late = await submit(api, tenant.queue_id)
        got, _ = await collect(ws, 1, ready["cursor"])
        assert [e["job_id"] for e in got] == [late]


async def test_the_authorization_header_works_too(api: Api, tenant: Tenant,
                                                  server: Server) -> None:
    job = await submit(api, tenant.queue_id)
    headers = [(b"authorization", f"Bearer {tenant.tokens['member']}".encode())]
    async with open_websocket_url(server.url(tenant.project_id), extra_headers=headers) as ws:
        assert ws.subprotocol is None
        ready = await frame(ws)
        got, _ = await collect(ws, 1, ready["cursor"])
        assert got[0]["job_id"] == job


async def test_a_revoked_session_ends_the_stream_within_a_cycle(api: Api, tenant: Tenant,
                                                                server: Server) -> None:
    token = tenant.tokens["viewer"]
    async with open_websocket_url(server.url(tenant.project_id),
                                  subprotocols=protocols(token)) as ws:
        await frame(ws)
        assert (await api.post("auth/logout", token=token)).status == 204
        code, reason, took = await closed(ws)
    assert code == 4001 and reason and "revoked" in reason
    assert took < TIMING.poll + 1.0, took
    # And it cannot come back.
    status, body, _ = await rejected(server.url(tenant.project_id),
                                     subprotocols=protocols(token))
    assert (status, body["code"]) == (401, "unauthenticated")


async def test_an_expired_session_ends_the_stream(api: Api, tenant: Tenant,
                                                  server: Server) -> None:
    token = tenant.tokens["viewer"]
    async with open_websocket_url(server.url(tenant.project_id),
                                  subprotocols=protocols(token)) as ws:
        await frame(ws)
        await api.sql("update fl.sessions set expires_at = fl.now() - interval '1 second'"
                      " where user_id = %s", tenant.users["viewer"])
        code, _, took = await closed(ws)
    assert code == 4001 and took < TIMING.poll + 1.0


async def test_removing_the_membership_ends_the_stream(api: Api, tenant: Tenant,
                                                       server: Server) -> None:
    async with open_websocket_url(server.url(tenant.project_id),
                                  subprotocols=protocols(tenant.tokens["member"])) as ws:
        await frame(ws)
        await api.sql("delete from fl.org_members where user_id = %s", tenant.users["member"])
        code, reason, took = await closed(ws)
    assert code == 4003 and reason and "no longer" in reason
    assert took < TIMING.poll + 1.0, took


async def test_the_fifth_stream_of_one_user_is_refused(api: Api, tenant: Tenant,
                                                       server: Server) -> None:
    url = server.url(tenant.project_id, "tail")
    viewer = protocols(tenant.tokens["viewer"])
    async with contextlib.AsyncExitStack() as stack:
        streams = [await stack.enter_async_context(open_websocket_url(url, subprotocols=viewer))
                   for _ in range(4)]
        for ws in streams:
            assert (await frame(ws))["type"] == "ready"
        status, body, headers = await rejected(url, subprotocols=viewer)
        assert (status, body["code"], headers["retry-after"]) == (429, "too_many_streams", "30")
        # Someone else is not affected.
        async with open_websocket_url(url, subprotocols=protocols(tenant.tokens["owner"])) as ws:
            assert (await frame(ws))["type"] == "ready"
        await streams[0].aclose()
        # The server notices the close, then admits again.
        await until(lambda: server.hub.open.get(f"user:{tenant.users['viewer']}") == 3)
        async with open_websocket_url(url, subprotocols=viewer) as ws:
            assert (await frame(ws))["type"] == "ready"


async def test_origins(api: Api, tenant: Tenant, server: Server) -> None:
    url = server.url(tenant.project_id)
    viewer = protocols(tenant.tokens["viewer"])
    # Same origin = same host and port (the scheme is not compared: TLS may end at a proxy).
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1",
                   f"http://{server.host}.evil.example"):
        status, body, _ = await rejected(url, subprotocols=viewer,
                                         extra_headers=[(b"origin", origin.encode())])
        assert (status, body["code"]) == (403, "origin_not_allowed"), origin
    same = [(b"origin", f"http://{server.host}".encode())]
    async with open_websocket_url(url, subprotocols=viewer, extra_headers=same) as ws:
        assert (await frame(ws))["type"] == "ready"


def test_allowed_origin_patterns() -> None:
    allowed = ("https://app.example.com", "https://*.example.org", "http://localhost:*")
    for origin in ("https://app.example.com", "HTTPS://App.Example.com/", "https://a.example.org",
                   "https://a.b.example.org", "http://localhost:5173"):
        assert origin_allowed(origin, "api.example.com", allowed), origin
    for origin in ("http://app.example.com", "https://app.example.com.evil.io",
                   "https://example.org", "https://evil.io/.example.org", "http://localhost",
                   "null", ""):
        assert not origin_allowed(origin, "api.example.com", allowed), origin
    assert origin_allowed(None, "api.example.com", ())
    assert origin_allowed("https://api.example.com", "api.example.com", ())
    assert not origin_allowed("https://api.example.com:8443", "api.example.com", ())
    assert not origin_allowed("null", "null", ())


async def test_refusals_before_the_upgrade(api: Api, tenant: Tenant, server: Server) -> None:
    viewer = protocols(tenant.tokens["viewer"])
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        (server.url(tenant.project_id), {}, 401, "unauthenticated"),
        (server.url(tenant.project_id), {"subprotocols": ["fl.v1", "fl.token.fls_nope"]},
         401, "unauthenticated"),
        (server.url(tenant.project_id), {"subprotocols": protocols(tenant.tokens["outsider"])},
         404, "not_found"),
        (server.url(tenant.other_project_id), {"subprotocols": viewer}, 404, "not_found"),
        (server.url(uuid.uuid4()), {"subprotocols": viewer}, 404, "not_found"),
        (server.url("not-a-uuid"), {"subprotocols": viewer}, 400, "invalid_input"),
        (server.url(tenant.project_id, "bogus"), {"subprotocols": viewer}, 400,
         "invalid_cursor"),
        (server.url(tenant.project_id, ""), {"subprotocols": viewer}, 400, "invalid_cursor"),
        (server.url(tenant.project_id, limit="5"), {"subprotocols": viewer}, 400,
         "invalid_input"),
        # The token alone would have to be echoed: refused, fl.v1 is required.
        (server.url(tenant.project_id), {"subprotocols": [viewer[1]]}, 400,
         "subprotocol_required"),
    ]
    for url, kw, status, code in cases:
        got_status, body, headers = await rejected(url, **kw)
        assert (got_status, body["code"]) == (status, code), (url, kw)
        assert headers["x-request-id"] == body["request_id"]
    assert server.hub.open == {}


async def test_heartbeat_and_client_messages(api: Api, tenant: Tenant, server: Server) -> None:
    async with open_websocket_url(server.url(tenant.project_id, "tail"),
                                  subprotocols=protocols(tenant.tokens["viewer"])) as ws:
        assert (await frame(ws))["type"] == "ready"
        assert await frame(ws, pings=True) == {"type": "ping"}   # idle: a heartbeat
        await ws.send_message("hello")
        code, reason, _ = await closed(ws)
    assert code == 1008 and reason and "no messages" in reason


async def test_a_cursor_behind_retention_is_refused_with_the_oldest(
        api: Api, tenant: Tenant, server: Server) -> None:
    await submit(api, tenant.queue_id)
    [(txid, event_id)] = await api.sql("select txid::text, id from fl.events")
    await api.sql("delete from fl.events")
    await api.sql("insert into fl.events_retention (project_id, txid, id)"
                  " values (%s, %s::xid8, %s)", tenant.project_id, txid, event_id)
    viewer = protocols(tenant.tokens["viewer"])
    status, body, _ = await rejected(server.url(tenant.project_id, Position(0, 0).encode()),
                                     subprotocols=viewer)
    assert (status, body["code"]) == (410, "cursor_too_old")
    assert body["oldest"] == Position(int(txid), event_id).encode()
    async with open_websocket_url(server.url(tenant.project_id), subprotocols=viewer) as ws:
        assert (await frame(ws)) == {"type": "ready", "cursor": body["oldest"]}


@pytest.mark.parametrize("channel", ["fl_queue", "fl_events"])
async def test_notifications_wake_streams_while_any_is_open(api: Api, tenant: Tenant,
                                                          server: Server, channel: str) -> None:
    # fl_events: completions on queues without a cap, which no worker listens for (0011).
    hub = server.hub
    assert not hub.listening
    async with open_websocket_url(server.url(tenant.project_id, "tail"),
                                  subprotocols=protocols(tenant.tokens["viewer"])) as ws:
        await frame(ws)
        assert hub.listening
        woken = False
        with trio.fail_after(WAIT):       # until the LISTEN is in place, a notify is lost
            while not woken:
                pulse = hub.pulse
                await api.sql("select pg_notify(%s, 'x')", channel)
                with trio.move_on_after(0.2):
                    await pulse.wait()
                woken = pulse.is_set()
    await until(lambda: not hub.listening)     # the last stream gone, the connection goes


async def add_events(api: Api, tenant: Tenant, count: int, payload_bytes: int = 10) -> None:
    """``count`` events in one transaction (one txid), as a hot path's burst would be."""
    await api.sql("insert into fl.events (project_id, queue_id, topic, payload)"
                  " select %s, %s, 'test.burst', jsonb_build_object('n', n, 'pad', repeat('x', %s))"
                  "   from generate_series(1, %s) n",
                  tenant.project_id, tenant.queue_id, payload_bytes, count)


async def test_a_long_replay_comes_in_frames_of_at_most_1000(api: Api, tenant: Tenant,
                                                            server: Server) -> None:
    await add_events(api, tenant, 2345)
    async with open_websocket_url(server.url(tenant.project_id),
                                  subprotocols=protocols(tenant.tokens["viewer"]),
                                  max_message_size=4 * 1024 * 1024) as ws:
        prev = (await frame(ws))["cursor"]
        sizes = []
        got: list[Any] = []
        while len(got) < 2345:
            batch = await frame(ws)
            assert batch["type"] == "batch" and batch["prev"] == prev
            sizes.append(len(batch["events"]))
            got += batch["events"]
            prev = batch["next"]
    assert sizes == [1000, 1000, 345]
    assert [e["payload"]["n"] for e in got] == list(range(1, 2346))



async def test_retention_overtaking_an_open_stream_ends_it(api: Api, tenant: Tenant,
                                                           server: Server) -> None:
    async with open_websocket_url(server.url(tenant.project_id, "tail"),
                                  subprotocols=protocols(tenant.tokens["viewer"])) as ws:
        await frame(ws)
        # A retention pass records a drop beyond where this stream stands.
        far = Position(2**40, 7)
        await api.sql("insert into fl.events_retention (project_id, txid, id)"
                      " values (%s, %s::xid8, %s)", tenant.project_id, str(far.txid), far.id)
        assert await frame(ws) == {"type": "cursor_too_old", "oldest": far.encode()}
        code, _, _ = await closed(ws)
    assert code == 4010
