"""Serve the app with hypercorn's Trio worker as a child of the supervisor.

SIGTERM sets ``shutdown`` (hypercorn's ``shutdown_trigger``): the listener closes, in-flight
requests get ``graceful_timeout`` to finish, ``after_serving`` runs. Cancelling the scope
instead would skip ``after_serving``, so cancel is kept for the hard stop only.
"""

from __future__ import annotations

import logging
import socket

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio import serve as hypercorn_serve

from fenceline.api.app import create_app
from fenceline.config import Settings
from fenceline.readiness import Readiness

log = logging.getLogger("fenceline.api")

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
