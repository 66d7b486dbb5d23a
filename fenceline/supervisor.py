"""The root nursery: every service of the process is a child task of it.

Shape, outermost first (each layer outlives the ones inside it, so shutdown runs inside-out):

    root nursery        signal watcher; hard-stop scope
      postgres          the embedded server, when there is no DATABASE_URL
        pool            the process's connections
          api           hypercorn; stops last so /readyz and in-flight requests answer
            services    database preparation, then one task per enabled role

A service is ``async def run(ctx, *, task_status)``: it calls ``task_status.started()`` once
it is ready, so start-up order is explicit. A service that crashes is logged and restarted
with capped exponential backoff; one that raises ``ConfigError`` stops the process, because
restarting cannot fix a configuration.

The first SIGTERM or SIGINT starts a drain: ``ctx.draining`` is set, services that drain
(workers) get ``drain_timeout`` to hand back or finish their jobs, the rest are cancelled,
then the API is told to shut down, then the pool and the server close. A second signal
stops at once.
"""

from __future__ import annotations

import logging
import signal
import socket

import psycopg
import trio

from fenceline.api.server import serve_api
from fenceline.config import Settings
from fenceline.db import migrator
from fenceline.db.connection import connect
from fenceline.db.listener import Listener
from fenceline.db.pool import Pool, PoolTimeout, open_pool
from fenceline.errors import ConfigError, find_exception
from fenceline.readiness import Readiness
from fenceline.service import Service, ServiceContext

log = logging.getLogger("fenceline.supervisor")

# Restart backoff for crashed services, and for an unreachable database at start-up.
BACKOFF_INITIAL = 0.5
BACKOFF_CAP = 30.0
# A service that ran this long before crashing is considered to have been healthy:
# its next crash starts the backoff again from the beginning.
HEALTHY_AFTER = 60.0
# Extra time past --drain-timeout for draining services to report what they released.
DRAIN_GRACE = 5.0


class Backoff:
    """Capped exponential backoff: 0.5, 1, 2, 4 ... 30 seconds."""

    def __init__(self, initial: float = BACKOFF_INITIAL, cap: float = BACKOFF_CAP) -> None:
        self.initial = initial
        self.cap = cap
        self.failures = 0

    def next_delay(self) -> float:
        delay = min(self.cap, self.initial * 2.0 ** self.failures)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0


class _FirstStart:
    """Forwards only the first ``started()`` of a restarted service to its starter."""

    def __init__(self, status: trio.TaskStatus[None]) -> None:
        self._status: trio.TaskStatus[None] | None = status

    def started(self, value: None = None) -> None:
        if self._status is not None:
            self._status.started()
            self._status = None


async def supervise_service(service: Service, ctx: ServiceContext, *,
                            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                            ) -> None:
    """Run ``service``; restart it with backoff when it crashes."""
    status = _FirstStart(task_status)
    backoff = Backoff()
    while True:
        began = trio.current_time()
        try:
            await service.run(ctx, task_status=status)
            return
        except Exception as exc:
            config_error = find_exception(exc, ConfigError)
            if config_error is not None:
                raise config_error from None
            if trio.current_time() - began >= HEALTHY_AFTER:
                backoff.reset()
            delay = backoff.next_delay()
            log.exception("service crashed; restarting",
                          extra={"service": service.name, "restart_in_s": delay})
        if ctx.draining.is_set():
            return
        with trio.move_on_after(delay):
            await ctx.draining.wait()
        if ctx.draining.is_set():
            return


def idle_service(name: str, why: str) -> Service:
    """A role whose work is not built yet: it says so and waits for the drain."""

    async def run(ctx: ServiceContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        log.info("role has nothing to run yet; idling", extra={"role": name, "why": why})
        task_status.started()
        await ctx.draining.wait()

    return Service(name, run, drains=True)


def services_for(settings: Settings) -> list[Service]:
    """The services the enabled roles start, in start-up order."""
    wanted: list[Service] = []
    if "scheduler" in settings.roles:
        from fenceline.scheduler.sweeps import scheduler_services

        wanted.extend(scheduler_services())
    if "archiver" in settings.roles:
        wanted.append(idle_service("archiver", "arrives with the archiver"))
    if "worker" in settings.roles:
        from fenceline.worker.service import run_worker_role

        wanted.append(Service("worker", run_worker_role, drains=True))
    return wanted


def check_port_free(settings: Settings) -> None:
    """Fail before anything starts if the API cannot bind its port."""
    if "api" not in settings.roles:
        return
    family = socket.AF_INET6 if ":" in settings.api_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((settings.api_addr, settings.api_port))
        except OSError as exc:
            reason = "already in use" if exc.errno == 98 else exc.strerror
            raise ConfigError(f"cannot listen on {settings.api_addr}:{settings.api_port}: "
                              f"{reason} (set --api-port / API_PORT)") from None


async def prepare_database(dsn: str, readiness: Readiness, pool: Pool) -> None:
    """Reach the database and apply migrations, retrying with backoff while unreachable.

    Migrations run on a connection of their own, never a pooled one: the migrator holds a
    session advisory lock, and a connection cancelled while holding it must be closed, not
    handed to the next user with the lock still taken.
    """
    backoff = Backoff()
    while True:
        try:
            readiness.reason = "connecting to the database"
            async with await connect(dsn) as conn:
                readiness.reason = "applying migrations"
                applied = await migrator.migrate(conn)
            break
        except migrator.MigrationError as exc:
            raise ConfigError(str(exc)) from None
        except (psycopg.OperationalError, PoolTimeout, OSError) as exc:
            delay = backoff.next_delay()
            reason = f"database unreachable: {str(exc).strip() or type(exc).__name__}"
            readiness.reason = reason
            log.warning("database not ready; retrying", extra={"reason": reason,
                                                              "retry_in_s": delay})
            await trio.sleep(delay)
    if applied:
        log.info("migrations applied", extra={"count": len(applied)})
    readiness.pool = pool
    readiness.reason = None


async def _watch_signals(draining: trio.Event, hard_stop: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if not draining.is_set():
                log.info("draining", extra={"signal": signal.Signals(signum).name})
                draining.set()
            else:
                log.warning("second signal: stopping now")
                hard_stop.cancel()
                return


async def _run_services(ctx: ServiceContext, dsn: str, services: list[Service]) -> None:
    scopes: list[tuple[Service, trio.CancelScope]] = []
    async with trio.open_nursery() as nursery:

        async def start(service: Service, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                scopes.append((service, scope))
                await supervise_service(service, ctx, task_status=task_status)

        with trio.CancelScope() as startup:
            nursery.start_soon(_cancel_on, ctx.draining, startup)
            await prepare_database(dsn, ctx.readiness, ctx.pool)
            ctx.listener = Listener(dsn, name="main")
            await nursery.start(start, Service("listener", _run_listener))
            for service in services:
                await nursery.start(start, service)
                log.info("service started", extra={"service": service.name})
            log.info("ready", extra={"roles": sorted(ctx.settings.roles)})
        await ctx.draining.wait()
        for service, scope in scopes:
            if not service.drains:
                scope.cancel()
        nursery.cancel_scope.deadline = (
            trio.current_time() + ctx.settings.drain_timeout + DRAIN_GRACE
        )


async def _run_listener(ctx: ServiceContext, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    assert ctx.listener is not None
    await ctx.listener.run(task_status=task_status)


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _with_database(settings: Settings, readiness: Readiness, dsn: str,
                         draining: trio.Event) -> None:
    async with open_pool(dsn, max_size=settings.pool_size, name="main") as pool:
        ctx = ServiceContext(settings, readiness, pool, dsn=dsn, draining=draining)
        api_shutdown = trio.Event()
        async with trio.open_nursery() as api_nursery:
            if "api" in settings.roles:
                binds = await api_nursery.start(serve_api, settings, readiness, api_shutdown)
                log.info("api listening", extra={"binds": binds})
            try:
                await _run_services(ctx, dsn, services_for(settings))
            finally:
                api_shutdown.set()
        readiness.pool = None


async def run(settings: Settings) -> None:
    """Run the process until drained or stopped. Raises ``ConfigError`` on bad config."""
    check_port_free(settings)
    readiness = Readiness()
    draining = trio.Event()
    async with trio.open_nursery() as root:
        root.start_soon(_watch_signals, draining, root.cancel_scope)
        async with trio.open_nursery() as postgres:
            if settings.database_url is not None:
                dsn = settings.database_url
            else:
                from fenceline.db import embedded

                server = await postgres.start(embedded.run_embedded, embedded.EmbeddedSettings(
                    data_dir=settings.data_dir or embedded.default_data_dir(),
                    run_as=settings.embedded_user,
                ))
                dsn = server.dsn
                readiness.embedded_dsn = dsn
            await _with_database(settings, readiness, dsn, draining)
            postgres.cancel_scope.cancel()
        root.cancel_scope.cancel()
    log.info("stopped")
