"""The faults, one function each. Each returns a ``FaultEvent`` the checks read back later.

sigkill        SIGKILL a worker holding jobs; start a new one a second later.
               Proves: its jobs run again elsewhere within lease + reaper interval.
sigstop        SIGSTOP a worker running a sleep job until the reaper has taken its jobs,
               then SIGCONT. Proves: the stale worker is fenced (its heartbeat, reports and
               side effects are refused) and then carries on.
terminate      pg_terminate_backend of 1-3 random fenceline connections. Proves: every
               connection comes back; nothing is lost or done twice.
pg_restart     Fast shutdown of the PostgreSQL server, then start it again. Proves: the
               whole fleet reconnects and carries on; nothing is lost.
expire_leases  Set 1-3 random leases' expires_at a second in the past. Proves: the reaper
               takes them from a live worker, whose late writes are refused.
sigterm        SIGTERM a worker holding jobs; start a new one. Proves: graceful drain: exit
               0, every job reported or released, none left to the reaper.

Two more in the long run:

sigterm_db_down  Stop the PostgreSQL server, SIGTERM a worker, start the server once the
                 worker is gone. Proves: a worker stops (exit 0, bounded) even when it
                 cannot reach its database (the bug this suite found; see
                 tests/worker/test_stop_without_database.py).
sigkill_scheduler  SIGKILL a scheduler replica; start a new one a second later. Proves: the
                 other replicas' sweeps carry on (jobs are still reaped in time).
"""

from __future__ import annotations

import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from tests.chaos.cluster import Fleet, PrivatePostgres, Proc
from tests.chaos.db import Db, DbDown

# Restart delay of a killed or drained worker.
RESPAWN_AFTER = 1.0
# How long a fault looks for a worker that holds jobs before it takes any worker.
PICK_PATIENCE = 5.0
# How long a worker told to stop may take with its database down: the sum of its bounded
# clean-up writes (draining heartbeat 10 s, a failure report 30 s, marking itself stopped
# 10 s, ...; measured 41-43 s when a handler's report was in flight).
STOP_WITHOUT_DATABASE_BOUND = 75.0


@dataclass
class FaultEvent:
    kind: str
    at: float  # wall clock when injected
    until: float | None = None  # sigstop: SIGCONT; pg_restart: back up
    pid: int | None = None
    worker_id: uuid.UUID | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rig:
    """Everything a fault may touch."""

    pg: PrivatePostgres
    fleet: Fleet
    db: Db
    queue: uuid.UUID
    server_nursery: trio.Nursery  # the server lives here, across restarts
    rng: random.Random
    lease: float
    reaper_interval: float
    drain_timeout: float


async def _holdings(rig: Rig) -> dict[int, tuple[uuid.UUID, int, int]]:
    """pid -> (worker id, leases held, chaos_sleep leases held), for live registered workers."""
    rows = await rig.db.retry(
        "select w.pid, w.id, count(l.job_id), count(l.job_id) filter (where j.type = 'chaos_sleep')"
        "  from fl.workers w left join fl.leases l on l.worker_id = w.id"
        "  left join fl.jobs j on j.id = l.job_id"
        " where w.state in ('active', 'draining') group by w.pid, w.id")
    return {int(pid): (wid, int(n), int(sleeping)) for pid, wid, n, sleeping in rows}


async def _pick_worker(rig: Rig, *, want_sleeping: bool = False) -> tuple[Proc, uuid.UUID | None]:
    """A live, running, registered worker that holds jobs (a sleep job if asked), if one
    shows up within PICK_PATIENCE seconds; else any live worker."""
    deadline = trio.current_time() + PICK_PATIENCE
    while True:
        holdings = await _holdings(rig)
        column = 2 if want_sleeping else 1
        candidates = [p for p in rig.fleet.workers.values()
                      if p.alive and not p.stopped and p.pid in holdings
                      and int(holdings[p.pid][column]) > 0]
        if candidates:
            chosen = rig.rng.choice(sorted(candidates, key=lambda p: p.slot))
            return chosen, holdings[chosen.pid][0]
        live = sorted((p for p in rig.fleet.workers.values()
                       if p.alive and not p.stopped and p.ready()), key=lambda p: p.slot)
        if trio.current_time() > deadline and live:
            chosen = rig.rng.choice(live)
            return chosen, holdings.get(chosen.pid, (None, 0, 0))[0]
        if trio.current_time() > deadline + 30:
            raise RuntimeError("no live worker to inject a fault into")
        await trio.sleep(0.1)


async def _respawn(rig: Rig, victim: Proc) -> None:
    await rig.fleet.retire(victim)
    await trio.sleep(RESPAWN_AFTER)
    await rig.fleet.spawn("worker", victim.slot)


async def sigkill(rig: Rig) -> FaultEvent:
    victim, worker_id = await _pick_worker(rig)
    held = await _held_by(rig, worker_id)
    event = FaultEvent("sigkill", time.time(), pid=victim.pid, worker_id=worker_id,
                       detail={"held": len(held)})
    victim.send(signal.SIGKILL)
    await victim.wait(10)
    await _respawn(rig, victim)
    return event


async def sigstop(rig: Rig) -> FaultEvent:
    victim, worker_id = await _pick_worker(rig, want_sleeping=True)
    held = await _held_by(rig, worker_id)
    event = FaultEvent("sigstop", time.time(), pid=victim.pid, worker_id=worker_id,
                       detail={"held": len(held), "pairs": held})
    victim.send(signal.SIGSTOP)
    began = trio.current_time()
    # Past its lease, and until the reaper has taken every job it held (bounded).
    await trio.sleep(rig.lease)
    deadline = began + rig.lease + rig.reaper_interval + 20
    left: list[tuple[int, int]] = held
    while left and trio.current_time() < deadline:
        left = await _still_leased(rig, left)
        if left:
            await trio.sleep(0.1)
    if left:
        # Not reaped in time: say what held it (a transaction of the stopped process?).
        event.detail["not_reaped"] = left
        event.detail["open_transactions"] = [tuple(r) for r in await rig.db.retry(
            "select application_name, state, left(query, 80) from pg_stat_activity"
            " where datname = current_database() and state like 'idle in transaction%'")]
    event.detail["stopped_s"] = round(trio.current_time() - began, 2)
    event.until = time.time()
    victim.send(signal.SIGCONT)
    return event


async def _still_leased(rig: Rig, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    rows = await rig.db.retry(
        "select l.job_id, l.fence from fl.leases l join unnest(%s::bigint[], %s::bigint[])"
        " as h(id, fence) on l.job_id = h.id and l.fence = h.fence",
        ([h[0] for h in pairs], [h[1] for h in pairs]))
    return [(int(j), int(f)) for j, f in rows]


async def terminate(rig: Rig) -> FaultEvent:
    rows = await rig.db.retry(
        "select pid, coalesce(application_name, '') from pg_stat_activity"
        " where datname = current_database() and backend_type = 'client backend'"
        "   and pid <> pg_backend_pid() and coalesce(application_name, '') not like 'chaos%'")
    chosen = rig.rng.sample(rows, min(len(rows), rig.rng.randint(1, 3)))
    event = FaultEvent("terminate", time.time(),
                       detail={"backends": sorted(name or "(pool)" for _, name in chosen)})
    for pid, _ in chosen:
        await rig.db.retry("select pg_terminate_backend(%s)", (pid,))
    return event


async def pg_restart(rig: Rig) -> FaultEvent:
    event = FaultEvent("pg_restart", time.time())
    down = await rig.pg.restart(rig.server_nursery)
    event.until = time.time()
    event.detail["down_s"] = round(down, 2)
    return event


async def expire_leases(rig: Rig) -> FaultEvent:
    rows = await rig.db.retry(
        "with picked as (select job_id from fl.leases where queue_id = %s"
        "                 order by random() limit %s)"
        " update fl.leases l set expires_at = now() - interval '1 second'"
        "   from picked where l.job_id = picked.job_id returning l.job_id, l.fence",
        (rig.queue, rig.rng.randint(1, 3)))
    return FaultEvent("expire_leases", time.time(),
                      detail={"leases": [(int(j), int(f)) for j, f in rows]})


async def sigterm(rig: Rig) -> FaultEvent:
    victim, worker_id = await _pick_worker(rig)
    held = await _held_by(rig, worker_id)
    event = FaultEvent("sigterm", time.time(), pid=victim.pid, worker_id=worker_id,
                       detail={"held": len(held)})
    began = trio.current_time()
    victim.send(signal.SIGTERM)
    code = await victim.wait(rig.drain_timeout + 30)
    event.detail["exit_code"] = code
    event.detail["drain_s"] = round(trio.current_time() - began, 2)
    await _respawn(rig, victim)
    return event


async def sigterm_db_down(rig: Rig) -> FaultEvent:
    victim, worker_id = await _pick_worker(rig)
    event = FaultEvent("sigterm_db_down", time.time(), pid=victim.pid, worker_id=worker_id)
    began = trio.current_time()
    await rig.pg.stop()
    victim.send(signal.SIGTERM)
    code = await victim.wait(STOP_WITHOUT_DATABASE_BOUND + 15)
    event.detail.update(exit_code=code, stop_s=round(trio.current_time() - began, 2))
    await rig.pg.start(rig.server_nursery)
    event.until = time.time()
    event.detail["down_s"] = round(trio.current_time() - began, 2)
    await _respawn(rig, victim)
    return event


async def sigkill_scheduler(rig: Rig) -> FaultEvent:
    victim = rig.rng.choice(sorted((p for p in rig.fleet.schedulers.values() if p.alive),
                                   key=lambda p: p.slot))
    event = FaultEvent("sigkill_scheduler", time.time(), pid=victim.pid)
    victim.send(signal.SIGKILL)
    await victim.wait(10)
    await rig.fleet.retire(victim)
    await trio.sleep(RESPAWN_AFTER)
    await rig.fleet.spawn("scheduler", victim.slot)
    return event


async def _held_by(rig: Rig, worker_id: uuid.UUID | None) -> list[tuple[int, int]]:
    if worker_id is None:
        return []
    try:
        rows = await rig.db.retry("select job_id, fence from fl.leases where worker_id = %s",
                                  (worker_id,))
    except DbDown:
        return []
    return [(int(j), int(f)) for j, f in rows]


FAULTS: dict[str, Callable[[Rig], Awaitable[FaultEvent]]] = {
    "sigkill": sigkill,
    "sigstop": sigstop,
    "terminate": terminate,
    "pg_restart": pg_restart,
    "expire_leases": expire_leases,
    "sigterm": sigterm,
}

# Faults of the long run only: the first keeps the fleet without a database for 20-45 s.
LONG_FAULTS: dict[str, Callable[[Rig], Awaitable[FaultEvent]]] = {
    **FAULTS,
    "sigterm_db_down": sigterm_db_down,
    "sigkill_scheduler": sigkill_scheduler,
}

# How often each kind is drawn for the faults after the first round (relative weights).
WEIGHTS = {"sigterm_db_down": 0.1}
