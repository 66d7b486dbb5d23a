"""Answers on a real hypercorn server: a sized answer's head and body leave in one write.

fenceline/api/server.py's OneWriteH11Protocol holds the head of a response that has a
Content-Length until its body (or its end) is written, so a small answer is one send: a
client's first read gets all of it. Keep-alive, empty bodies, HEAD and errors still answer
as HTTP/1.1 says; the websocket upgrade (101, no length) is covered by test_stream.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial

import h11
import pytest
import trio
from hypercorn.trio import serve as hypercorn_serve

from fenceline.api.app import create_app
from fenceline.api.server import hypercorn_config
from fenceline.config import Settings
from fenceline.db.pool import Pool
from fenceline.readiness import Readiness
from tests.api.conftest import Api, Tenant


@pytest.fixture
async def address(pool: Pool, nursery: trio.Nursery) -> AsyncIterator[tuple[str, int]]:
    settings = Settings(api_addr="127.0.0.1", api_port=0, password_profile="minimal")
    app = create_app(Readiness(pool=pool, reason=None), settings)
    shutdown = trio.Event()
    binds = await nursery.start(partial(hypercorn_serve, app, hypercorn_config(settings),
                                        shutdown_trigger=shutdown.wait))
    host, port = binds[0].removeprefix("http://").rsplit(":", 1)
    yield host, int(port)
    shutdown.set()


def _request(method: str, target: str, body: bytes = b"", token: str | None = None) -> bytes:
    head = [f"{method} {target} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    if body:
        head.append("Content-Type: application/json")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _answer(stream: trio.SocketStream, client: h11.Connection,
                  first: list[bytes]) -> tuple[int, dict[bytes, bytes], bytes]:
    """Read one answer; ``first`` gets the bytes of the first read."""
    status, headers, body = 0, {}, b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            if not first:
                first.append(data)
            client.receive_data(data)
            continue
        if isinstance(event, h11.Response):
            status, headers = event.status_code, dict(event.headers)
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            client.start_next_cycle()
            return status, headers, body


async def test_a_sized_answer_is_one_write_and_keep_alive_holds(
        address: tuple[str, int], api: Api, tenant: Tenant) -> None:
    token = tenant.tokens["member"]
    submit = json.dumps({"type": "t", "payload": {"n": 1}}).encode()
    sent = [
        ("POST", f"/api/v1/queues/{tenant.queue_id}/jobs", submit, token, 201),
        ("GET", "/readyz", b"", None, 200),
        ("HEAD", "/readyz", b"", None, 200),
        ("GET", "/api/v1/no-such-thing", b"", None, 404),
        ("POST", f"/api/v1/queues/{tenant.queue_id}/jobs", submit, "fls_nope", 401),
        ("POST", "/api/v1/auth/logout", b"", tenant.tokens["viewer"], 204),
        ("POST", f"/api/v1/queues/{tenant.queue_id}/jobs", submit, token, 201),
    ]
    async with await trio.open_tcp_stream(*address) as stream:
        client = h11.Connection(h11.CLIENT)
        for method, target, body, tok, want in sent:
            await stream.send_all(_request(method, target, body, tok))
            client.send(h11.Request(method=method, target=target,
                                    headers=[("Host", "test"),
                                             ("Content-Length", str(len(body)))]))
            if body:
                client.send(h11.Data(data=body))
            client.send(h11.EndOfMessage())
            first: list[bytes] = []
            status, headers, got = await _answer(stream, client, first)
            assert status == want, (method, target, status, got)
            length = int(headers.get(b"content-length", b"0"))
            if method == "HEAD":
                assert got == b""
            else:
                assert len(got) == length
                # Head and body came in one write, so the first read holds all of it.
                assert first[0].endswith(got), (method, target)
    [(n,)] = await api.sql("select count(*) from fl.jobs")
    assert n >= 1
