"""The supervisor's restart policy and drain, on Trio's virtual clock."""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing

from fenceline.config import Settings
from fenceline.errors import ConfigError
from fenceline.readiness import Readiness
from fenceline.supervisor import (
    BACKOFF_CAP,
    Backoff,
    Service,
    ServiceContext,
    idle_service,
    services_for,
    supervise_service,
)


def make_ctx() -> ServiceContext:
    return ServiceContext(Settings(), Readiness(), pool=None)  # type: ignore[arg-type]


def test_backoff_doubles_and_caps() -> None:
    b = Backoff()
    delays = [b.next_delay() for _ in range(10)]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(delays) == BACKOFF_CAP
    b.reset()
    assert b.next_delay() == 0.5


async def test_a_crashing_service_is_restarted_with_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []

    async def flaky(ctx: ServiceContext, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        starts.append(trio.current_time())
        if len(starts) < 4:
            raise RuntimeError("boom")
        task_status.started()

    ctx = make_ctx()
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise_service, Service("flaky", flaky), ctx)
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(starts)]
    assert gaps == [0.5, 1.0, 2.0]


async def test_started_is_forwarded_once_across_restarts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    runs = 0

    async def starts_then_crashes(ctx: ServiceContext, *,
                                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                                  ) -> None:
        nonlocal runs
        runs += 1
        task_status.started()  # a second started() on a real TaskStatus would raise
        if runs < 3:
            raise RuntimeError("crash after start")
        await ctx.draining.wait()

    ctx = make_ctx()
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise_service, Service("s", starts_then_crashes), ctx)
        await trio.sleep(10)
        ctx.draining.set()
    assert runs == 3


async def test_a_config_error_is_not_restarted(autojump_clock: trio.testing.MockClock) -> None:
    runs = 0

    async def misconfigured(ctx: ServiceContext, *,
                            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                            ) -> None:
        nonlocal runs
        runs += 1
        raise ConfigError("bad setting")

    with pytest.raises(ConfigError, match="bad setting"):
        await supervise_service(Service("m", misconfigured), make_ctx())
    assert runs == 1


async def test_no_restart_once_draining(autojump_clock: trio.testing.MockClock) -> None:
    runs = 0
    ctx = make_ctx()

    async def crashes(ctx: ServiceContext, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal runs
        runs += 1
        ctx.draining.set()
        raise RuntimeError("crash during drain")

    await supervise_service(Service("c", crashes), ctx)
    assert runs == 1


async def test_idle_role_returns_on_drain(autojump_clock: trio.testing.MockClock) -> None:
    ctx = make_ctx()
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise_service, idle_service("worker", "not built"), ctx)
        ctx.draining.set()
    assert ctx.draining.is_set()


def test_roles_choose_services() -> None:
    names = [s.name for s in services_for(Settings(roles=frozenset({"worker"})))]
    assert names == ["worker"]
    assert services_for(Settings(roles=frozenset({"api"}))) == []
