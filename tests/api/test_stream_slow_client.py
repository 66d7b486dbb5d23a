"""A websocket client that stops reading loses its stream (and its slot) within a bound.

hypercorn shields its socket writes from cancellation, so the stream's own 10 s send timeout
cannot end a write that waits for a client that never reads; the kernel's TCP_USER_TIMEOUT
(fenceline/api/server.py) does, by aborting a connection whose data stays unsent behind a
zero window. The server here uses a 1 s stall timeout; the client does the handshake and
then never reads while the server streams ~18 MB of events at it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import pytest
import trio
from hypercorn.trio import serve as hypercorn_serve
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request

from fenceline.api.app import create_app
from fenceline.api.server import hypercorn_config
from fenceline.config import Settings
from fenceline.db.pool import Pool
from fenceline.readiness import Readiness
from tests.api.conftest import Api, Tenant
from tests.api.test_stream import TIMING, Server

pytestmark = pytest.mark.slow

STALL = 1.0


@pytest.fixture
async def stalling_server(pool: Pool, nursery: trio.Nursery) -> AsyncIterator[Server]:
    settings = Settings(api_addr="127.0.0.1", api_port=0, password_profile="minimal")
    app = create_app(Readiness(pool=pool, reason=None), settings)
    app.config["FENCELINE_STREAM_TIMING"] = TIMING
    config = hypercorn_config(settings)
    config.send_stall_timeout = STALL
    shutdown = trio.Event()
    binds = await nursery.start(partial(hypercorn_serve, app, config,
                                        shutdown_trigger=shutdown.wait))
    yield Server(binds[0].removeprefix("http://"), app.config["FENCELINE_STREAM_HUB"])
    shutdown.set()


async def test_a_client_that_stops_reading_is_dropped(api: Api, tenant: Tenant,
                                                      stalling_server: Server) -> None:
    await api.sql("insert into fl.events (project_id, topic, payload)"
                  " select %s, 'test.bulk', jsonb_build_object('pad', repeat('x', 600))"
                  "   from generate_series(1, 30000)", tenant.project_id)
    host, port = stalling_server.host.split(":")
    client = WSConnection(ConnectionType.CLIENT)
    async with await trio.open_tcp_stream(host, int(port)) as sock:
        await sock.send_all(client.send(Request(
            host=stalling_server.host,
            target=f"/api/v1/projects/{tenant.project_id}/events/stream",
            subprotocols=["fl.v1"],
            extra_headers=[(b"authorization",
                            f"Bearer {tenant.tokens['viewer']}".encode())])))
        with trio.fail_after(10):
            accepted = False
            while not accepted:
                client.receive_data(await sock.receive_some(1024))
                accepted = any(isinstance(e, AcceptConnection) for e in client.events())
        # From here on the client never reads again.
        # The hub has no change event to wait on: poll its table of open streams.
        with trio.fail_after(5):
            while not stalling_server.hub.open:  # noqa: ASYNC110
                await trio.sleep(0.05)
        with trio.fail_after(30):
            while stalling_server.hub.open:  # noqa: ASYNC110
                await trio.sleep(0.1)
    assert stalling_server.hub.open == {}
