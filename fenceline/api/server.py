"""Serve the app with hypercorn's Trio worker as a child of the supervisor.

SIGTERM sets ``shutdown`` (hypercorn's ``shutdown_trigger``): the listener closes, in-flight
requests get ``graceful_timeout`` to finish, ``after_serving`` runs. Cancelling the scope
instead would skip ``after_serving``, so cancel is kept for the hard stop only.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import trio
from hypercorn import protocol as hypercorn_protocol
from hypercorn.config import Config, Sockets
from hypercorn.events import RawData
from hypercorn.protocol import h11 as hypercorn_h11
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import serve as hypercorn_serve

from fenceline.api.app import create_app
from fenceline.config import Settings
from fenceline.readiness import Readiness

log = logging.getLogger("fenceline.api")

# hypercorn's own h11 (a dependency of hypercorn's, not one of ours).
h11 = hypercorn_h11.h11  # type: ignore[attr-defined]

GRACEFUL_TIMEOUT = 5.0

# A connection whose sent data has stayed unacknowledged (or unsent behind a zero window: a
# client that stopped reading) this long is aborted by the kernel. hypercorn shields its
# socket writes from cancellation, so without this a websocket client that stops reading
# would hold its task and its stream slot until TCP gave up on its own (minutes to hours).
SEND_STALL_TIMEOUT = 20.0


class ServerConfig(Config):
    """hypercorn's Config, plus TCP_USER_TIMEOUT on the listening sockets (Linux copies it
    to every accepted connection)."""

    send_stall_timeout: float = SEND_STALL_TIMEOUT

    def create_sockets(self) -> Sockets:
        sockets = super().create_sockets()
        option = getattr(socket, "TCP_USER_TIMEOUT", None)
        for sock in [*sockets.secure_sockets, *sockets.insecure_sockets]:
            if option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, option,
                                int(self.send_stall_timeout * 1000))
        return sockets


class OneWriteH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, writing a sized response's head and body in one send.

    hypercorn writes the head of a response as soon as the app starts it, and the body as a
    second write. On loopback each write is a system call that also runs the receiver's TCP
    path and wakes it, and a small JSON answer paid for two. A head that carries a
    Content-Length (everything but a streamed answer, which stays as it was: its head goes
    out at once) is now held until the next write of the response, its body or its end,
    which the app sends right after it.
    """

    _held = b""

    async def _send_h11_event(self, event: Any) -> None:
        if isinstance(event, h11.Response) and any(
                name == b"content-length" for name, _ in event.headers):
            try:
                self._held = self.connection.send(event) or b""
            except h11.LocalProtocolError:
                if self.connection.their_state != h11.ERROR:
                    raise
            return
        held, self._held = self._held, b""
        if not held:
            await super()._send_h11_event(event)
            return
        try:
            data = self.connection.send(event) or b""
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            data = b""
        await self.send(RawData(data=held + data))


# hypercorn's connection wrapper picks its HTTP/1.1 protocol by this module-level name; every
# server of this process (fenceline's is the only one) uses the one above from here on.
hypercorn_protocol.H11Protocol = OneWriteH11Protocol  # type: ignore[attr-defined]


def hypercorn_config(settings: Settings) -> ServerConfig:
    cfg = ServerConfig()
    host = f"[{settings.api_addr}]" if ":" in settings.api_addr else settings.api_addr
    cfg.bind = [f"{host}:{settings.api_port}"]
    cfg.graceful_timeout = GRACEFUL_TIMEOUT
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hypercorn.error")
    return cfg


async def serve_api(settings: Settings, readiness: Readiness, shutdown: trio.Event,
                    *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until ``shutdown`` is set; ``started`` carries the bound addresses."""
    await hypercorn_serve(create_app(readiness, settings), hypercorn_config(settings),
                          shutdown_trigger=shutdown.wait, task_status=task_status)
