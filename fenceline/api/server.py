"""Serve the app with hypercorn's Trio worker as a child of the supervisor.

SIGTERM sets ``shutdown`` (hypercorn's ``shutdown_trigger``): the listener closes, in-flight
requests get ``graceful_timeout`` to finish, ``after_serving`` runs. Cancelling the scope
instead would skip ``after_serving``, so cancel is kept for the hard stop only.
"""

from __future__ import annotations

import logging

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from fenceline.api.app import create_app
from fenceline.config import Settings
from fenceline.readiness import Readiness

log = logging.getLogger("fenceline.api")

GRACEFUL_TIMEOUT = 5.0


def hypercorn_config(settings: Settings) -> Config:
    cfg = Config()
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
