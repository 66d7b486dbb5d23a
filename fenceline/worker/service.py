"""The ``worker`` role of ``fenceline run``: the built-in handlers on one queue."""

from __future__ import annotations

import logging

import trio

from fenceline.engine.calls import EngineInputError
from fenceline.errors import ConfigError
from fenceline.service import ServiceContext
from fenceline.worker.builtins import BUILTINS
from fenceline.worker.runtime import Worker

log = logging.getLogger("fenceline.worker")


async def run_worker_role(ctx: ServiceContext, *,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
    settings = ctx.settings
    if settings.queue is None:
        log.info("worker role: no --queue / FENCELINE_QUEUE given; idling")
        task_status.started()
        await ctx.draining.wait()
        return
    worker = Worker(settings.queue, concurrency=settings.concurrency, lease=settings.lease,
                    drain_timeout=settings.drain_timeout)
    for job_type, handler in BUILTINS.items():
        worker.handler(job_type)(handler)
    try:
        await worker.run(ctx.dsn, draining=ctx.draining, listener=ctx.listener,
                         task_status=_started(task_status))
    except EngineInputError as exc:
        raise ConfigError(f"--queue {settings.queue}: {exc}") from None


def _started(status: trio.TaskStatus[None]) -> trio.TaskStatus[object]:
    class Forward:
        def started(self, value: object = None) -> None:
            status.started()

    return Forward()
