"""What a service is, and what every service receives from the supervisor."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from fenceline.config import Settings
from fenceline.db.listener import Listener
from fenceline.db.pool import Pool
from fenceline.readiness import Readiness


@dataclass
class ServiceContext:
    """What every service receives."""

    settings: Settings
    readiness: Readiness
    pool: Pool
    dsn: str = ""
    listener: Listener | None = None
    draining: trio.Event = field(default_factory=trio.Event)


class ServiceRun(Protocol):
    def __call__(self, ctx: ServiceContext, *,
                 task_status: trio.TaskStatus[None] = ...) -> Awaitable[None]: ...


@dataclass(frozen=True)
class Service:
    name: str
    run: ServiceRun
    # True for services that finish their own work on drain (workers); False for loops
    # that are simply cancelled when the drain starts (sweeps).
    drains: bool = False
