"""The stream of jobs, the operator's replays, and the in-flight sampler.

The mix (per submitted job): 45% ``chaos_sleep`` of 100 ms to 3 s (a tenth of them run
four times longer than their timeout on their first attempt, so they time out once), 30%
``chaos_noop``, 20% ``chaos_fail`` failing their first one or two attempts, 5% ``chaos_fail``
failing permanently (dead letter). Every few seconds an operator replays a couple of
dead-lettered jobs, so some jobs live through a second replay generation.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import trio
from psycopg.types.json import Jsonb

from tests.chaos.db import Db, DbDown

SAMPLE_INTERVAL = 0.1


def next_job(rng: random.Random) -> tuple[str, dict[str, Any], int | None]:
    """(type, payload, timeout_ms or None for the queue's default)."""
    roll = rng.random()
    if roll < 0.45:
        ms = rng.choice([rng.randint(100, 1000), rng.randint(100, 1000), rng.randint(1000, 3000)])
        if rng.random() < 0.1:
            return "chaos_sleep", {"ms": ms, "slow_attempts": 1}, 2 * ms + 100
        return "chaos_sleep", {"ms": ms}, None
    if roll < 0.75:
        return "chaos_noop", {}, None
    if roll < 0.95:
        return "chaos_fail", {"fail_first": rng.choice([1, 2])}, None
    return "chaos_fail", {"permanent": True}, None


@dataclass
class LoadStats:
    acknowledged: list[int] = field(default_factory=list)  # job ids fl.submit returned
    unanswered: int = 0  # submits whose outcome we never heard (server down meanwhile)
    replayed: int = 0


async def submit_stream(db: Db, queue: uuid.UUID, rate: float, rng: random.Random,
                        stats: LoadStats, stop: trio.Event) -> None:
    """Submit about ``rate`` jobs a second until ``stop`` is set. Never retries a submit:
    one whose answer was lost may or may not exist, and the checks look at every job that
    does."""
    while not stop.is_set():
        job_type, payload, timeout_ms = next_job(rng)
        try:
            job_id = await db.val(
                "select job_id from fl.submit(p_queue => %s, p_type => %s, p_payload => %s,"
                " p_timeout_ms => %s)", (queue, job_type, Jsonb(payload), timeout_ms))
            stats.acknowledged.append(int(job_id))
        except DbDown:
            stats.unanswered += 1
            await trio.sleep(0.2)
        with trio.move_on_after(rng.expovariate(rate)):
            await stop.wait()


async def replay_dead(db: Db, queue: uuid.UUID, every: float, stats: LoadStats,
                      stop: trio.Event) -> None:
    """An operator replaying up to two dead-lettered jobs every ``every`` seconds."""
    while not stop.is_set():
        with trio.move_on_after(every):
            await stop.wait()
        if stop.is_set():
            return
        try:
            ids = await db.rows("select id from fl.jobs where queue_id = %s"
                                " and status = 'dead_letter' order by random() limit 2",
                                (queue,))
            for (job_id,) in ids:
                if await db.val("select outcome from fl.replay(%s)", (job_id,)) == "ok":
                    stats.replayed += 1
        except DbDown:
            pass


@dataclass
class InFlight:
    samples: int = 0
    missed: int = 0  # the server was unreachable
    max_leases: int = 0
    max_running: int = 0
    over_cap: list[tuple[float, int, int]] = field(default_factory=list)  # (t, leases, running)


async def sample_in_flight(db: Db, queue: uuid.UUID, cap: int, result: InFlight,
                           stop: trio.Event) -> None:
    """Count the queue's leases and running jobs (one snapshot) every 100 ms."""
    while not stop.is_set():
        try:
            leases, running = (await db.rows(
                "select (select count(*) from fl.leases where queue_id = %(q)s),"
                " (select count(*) from fl.jobs where queue_id = %(q)s and status = 'running')",
                {"q": queue}))[0]
            result.samples += 1
            result.max_leases = max(result.max_leases, leases)
            result.max_running = max(result.max_running, running)
            if leases > cap or running > cap:
                result.over_cap.append((trio.current_time(), leases, running))
        except DbDown:
            result.missed += 1
        with trio.move_on_after(SAMPLE_INTERVAL):
            await stop.wait()
