"""The ``worker`` role of ``fenceline run``: the built-in handlers on one queue."""

from __future__ import annotations

import importlib
import logging

import trio

from fenceline.engine.calls import EngineInputError
from fenceline.errors import ConfigError
from fenceline.service import ServiceContext
from fenceline.worker.builtins import BUILTINS
from fenceline.worker.runtime import Handler, Worker

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
    for job_type, handler in {**BUILTINS, **load_handlers(settings.handlers)}.items():
        worker.handler(job_type)(handler)
    try:
        await worker.run(ctx.dsn, draining=ctx.draining, listener=ctx.listener,
                         task_status=_started(task_status))
    except EngineInputError as exc:
        raise ConfigError(f"--queue {settings.queue}: {exc}") from None


def load_handlers(module_name: str | None) -> dict[str, Handler]:
    """The ``HANDLERS`` dict of ``module_name`` (``--handlers``); they override built-ins."""
    if module_name is None:
        return {}
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--handlers {module_name}: cannot import it: {exc}") from None
    handlers = getattr(module, "HANDLERS", None)
    if not isinstance(handlers, dict) or not all(
        isinstance(k, str) and callable(v) for k, v in handlers.items()
    ):
        raise ConfigError(f"--handlers {module_name}: the module must define HANDLERS, "
                          "a dict of job type -> callable")
    return handlers


def _started(status: trio.TaskStatus[None]) -> trio.TaskStatus[object]:
    class Forward:
        def started(self, value: object = None) -> None:
            status.started()

    return Forward()
