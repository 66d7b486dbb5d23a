"""The worker runtime: claim, run, heartbeat, report, drain.

Why it is shaped this way (measured in reference/claim-prototype.md): throughput is bound by
one claim round trip per batch, so the claimer asks for as many jobs as there are free
slots, in one call, and never more (no prefetch beyond free concurrency: a claimed job
starts at once or is not claimed). Claims and reports use two connections so the claim
path never waits behind a completion flush. Completions are batched: whatever finished
while the previous flush ran goes out in the next single statement.

Ownership: every held job has a cancel scope. The heartbeat extends all leases in one
statement and gets back only the jobs that need attention; a job reported ``fenced`` (the
reaper or an operator took it) has its handler cancelled at once, and its late result is
never reported. Each handler runs under a deadline; running out of it is reported as
``timeout``, not ``lost``.

Drain (``draining`` set, e.g. by SIGTERM): stop claiming; a job claimed but not yet started
is released at once (no attempt used); running handlers get ``drain_timeout`` to finish;
what is still running then is cancelled and released.
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import logging
import os
import socket
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from fenceline.db.listener import Listener
from fenceline.engine import calls
from fenceline.worker.job import Job, PermanentError, Snooze
from fenceline.worker.link import Link

log = logging.getLogger("fenceline.worker")

Handler = Callable[[Job], Awaitable[Any]] | Callable[[Job], Any]

NOTIFY_CHANNEL = "fl_queue"
# Ceiling on how long an idle claimer sleeps when no notification arrives: the poll behind
# every push.
POLL_INTERVAL = 1.0
# Bound on each shielded clean-up write (release, final flush) during shutdown.
CLEANUP_TIMEOUT = 10.0


@dataclass
class _Held:
    """A job this worker owns until its report is written."""

    job: Job
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    started: bool = False
    slot_freed: bool = False
    cancel_reason: str | None = None  # lost | cancel_requested | drain


@dataclass
class WorkerStats:
    claimed: int = 0
    completed: int = 0
    failed: int = 0
    snoozed: int = 0
    released: int = 0
    fenced: int = 0
    lost_leases: int = 0


class Worker:
    """Runs handlers for the jobs of one queue.

    ``queue`` is a queue id or an ``organization/project/queue`` path.
    """

    def __init__(self, queue: str, *, concurrency: int = 16, lease: float = 30.0,
                 drain_timeout: float = 30.0, poll_interval: float = POLL_INTERVAL) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if lease < 1:
            raise ValueError("lease must be at least 1 second")
        self.queue = queue
        self.concurrency = concurrency
        self.lease = lease
        self.drain_timeout = drain_timeout
        self.poll_interval = poll_interval
        self.handlers: dict[str, Handler] = {}
        self.stats = WorkerStats()
        self.worker_id: uuid.UUID | None = None

    def handler(self, job_type: str) -> Callable[[Handler], Handler]:
        """Register the decorated function as the handler of ``job_type``."""
        if not job_type or len(job_type) > 200:
            raise ValueError("job type must be 1 to 200 characters")

        def register(fn: Handler) -> Handler:
            if job_type in self.handlers:
                raise ValueError(f"a handler for {job_type!r} is already registered")
            self.handlers[job_type] = fn
            return fn

        return register

    async def run(self, database_url: str, *, draining: trio.Event | None = None,
                  listener: Listener | None = None,
                  task_status: trio.TaskStatus[uuid.UUID] = trio.TASK_STATUS_IGNORED) -> None:
        """Work until ``draining`` is set (or cancelled); ``started`` means claiming."""
        if not self.handlers:
            raise ValueError("register at least one handler before running the worker")
        run = _Run(self, database_url, draining if draining is not None else trio.Event(),
                   listener)
        await run.main(task_status)

    def run_sync(self, database_url: str) -> None:
        """Run from plain (non-Trio) code until SIGINT/SIGTERM, then drain."""
        import signal

        async def main() -> None:
            draining = trio.Event()
            async with trio.open_nursery() as nursery:
                async def watch() -> None:
                    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                        async for _ in signals:
                            draining.set()
                            return

                nursery.start_soon(watch)
                await self.run(database_url, draining=draining)
                nursery.cancel_scope.cancel()

        trio.run(main)


class _Run:
    """One run of a worker: its connections, held jobs and loops."""

    def __init__(self, worker: Worker, dsn: str, draining: trio.Event,
                 listener: Listener | None) -> None:
        self.w = worker
        self.dsn = dsn
        self.draining = draining
        self.listener = listener
        self.claim_link = Link(dsn, "claim")
        self.report_link = Link(dsn, "report")
        self.held: dict[int, _Held] = {}
        self.is_async = {t: inspect.iscoroutinefunction(h) for t, h in worker.handlers.items()}
        self.running = 0  # handlers running (slots in use)
        self.wake = trio.Event()
        self.worker_id = uuid.uuid4()  # replaced by the registered id
        self.queue_id = uuid.uuid4()
        send, receive = trio.open_memory_channel[tuple[_Held, Any]](worker.concurrency * 4)
        self.completions_in = send
        self.completions_out = receive

    # -- life cycle ----------------------------------------------------------------------------

    async def main(self, task_status: trio.TaskStatus[uuid.UUID]) -> None:
        registered = False
        try:
            await self._register()
            registered = True
            async with trio.open_nursery() as loops:
                if self.listener is None:
                    self.listener = Listener(self.dsn, name="worker")
                    await loops.start(self.listener.run)
                loops.start_soon(self._wake_on_notify)
                loops.start_soon(self._heartbeat_loop)
                loops.start_soon(self._complete_loop)
                async with trio.open_nursery() as handlers:
                    with trio.CancelScope() as claiming:
                        loops.start_soon(_cancel_when, self.draining, claiming)
                        task_status.started(self.worker_id)
                        await self._claim_loop(handlers)
                    await self._drain(handlers)
                self.completions_in.close()  # the complete loop flushes what is left and ends
                with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT):
                    await self._flush_done.wait()
                loops.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT):
                if registered:
                    await self._mark_stopped()
                await self.claim_link.aclose()
                await self.report_link.aclose()

    async def _register(self) -> None:
        types = sorted(self.w.handlers)
        self.queue_id = await self.claim_link.call(
            lambda c: calls.resolve_queue(c, self.w.queue))
        self.worker_id = await self.claim_link.call(lambda c: calls.register_worker(
            c, [self.queue_id], types, socket.gethostname()[:255], os.getpid(),
            self.w.concurrency, {"lease_s": self.w.lease}))
        self.w.worker_id = self.worker_id
        log.info("worker registered", extra={"worker": str(self.worker_id),
                                             "queue": str(self.queue_id), "types": types,
                                             "concurrency": self.w.concurrency})

    async def _mark_stopped(self) -> None:
        try:
            await self.report_link.call(
                lambda c: calls.worker_heartbeat(c, self.worker_id, "stopped"))
        except Exception:
            log.warning("could not mark the worker stopped", exc_info=True)
        log.info("worker stopped", extra={"worker": str(self.worker_id), **vars(self.w.stats)})

    async def _drain(self, handlers: trio.Nursery) -> None:
        """Claiming has stopped: let handlers finish up to the drain timeout, then cancel."""
        # Bounded: with the database unreachable the link retries for ever, and a shield
        # without a bound would keep the process from stopping at all.
        with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT):
            await self.report_link.call(
                lambda c: calls.worker_heartbeat(c, self.worker_id, "draining"))
        if self.running:
            log.info("draining: waiting for running handlers",
                     extra={"running": self.running, "timeout_s": self.w.drain_timeout})
        # Handlers are cancelled one by one (not via the nursery scope) so that each knows
        # why and releases its own job; the nursery deadline below is only a backstop.
        with trio.move_on_after(self.w.drain_timeout):
            while self.running:
                await self._slot_freed()
        for held in list(self.held.values()):
            if held.cancel_reason is None and not held.scope.cancel_called:
                held.cancel_reason = "drain"
                held.scope.cancel()
                held.job._mark_cancelled()  # as the heartbeat does: before the handler unwinds
        handlers.cancel_scope.deadline = trio.current_time() + CLEANUP_TIMEOUT

    # -- claiming ------------------------------------------------------------------------------

    async def _claim_loop(self, handlers: trio.Nursery) -> None:
        types = sorted(self.w.handlers)
        while True:
            # A fresh event before looking: whatever happens from here on (a slot frees, a
            # notification) wakes the wait below, and nothing that happened before does.
            self.wake = trio.Event()
            free = self.w.concurrency - self.running
            wait_until: float | None = None
            if free > 0:
                result = await self.claim_link.call(
                    functools.partial(self._claim, types=types, n=free))
                if result.jobs:
                    offset = _wall_to_trio()  # one clock reading for the whole batch
                    for claimed in result.jobs:
                        self._start(handlers, claimed, offset)
                if len(result.jobs) == free:
                    continue  # there may be more: claim again as soon as a slot frees
                if result.retry_at is not None:
                    wait_until = _trio_time_of(result.retry_at)
            deadline = trio.current_time() + self.w.poll_interval
            if wait_until is not None:
                deadline = min(deadline, max(wait_until, trio.current_time()))
            with trio.move_on_at(deadline):
                await self.wake.wait()

    async def _claim(self, conn: Any, *, types: list[str], n: int) -> calls.ClaimResult:
        return await calls.claim(conn, self.queue_id, self.worker_id, types, n, self.w.lease)

    def _start(self, handlers: trio.Nursery, claimed: calls.ClaimedJob,
               wall_to_trio: float) -> None:
        job = Job(id=claimed.id, type=claimed.type, payload=claimed.payload,
                  fence=claimed.fence, attempt=claimed.attempt, queue_id=self.queue_id,
                  deadline_at=claimed.deadline_at)
        held = _Held(job)
        # One scope for both ways a handler is stopped: its deadline, and a cancel with a
        # reason (lease lost, cancel requested, drain). No reason means the deadline.
        held.scope.deadline = wall_to_trio + claimed.deadline_at.timestamp()
        self.held[job.id] = held
        self.running += 1
        self.w.stats.claimed += 1
        handlers.start_soon(self._run_job, held, name=f"job-{job.id}")

    async def _wake_on_notify(self) -> None:
        assert self.listener is not None
        mine = str(self.queue_id)
        with self.listener.subscribe(NOTIFY_CHANNEL) as wakeups:
            async for payload in wakeups:
                if payload == mine or payload.startswith("\x00"):
                    self.wake.set()

    async def _slot_freed(self) -> None:
        event = self._slot_event = trio.Event()
        await event.wait()

    _slot_event: trio.Event | None = None

    def _free_slot(self) -> None:
        self.running -= 1
        self.wake.set()
        if self._slot_event is not None:
            self._slot_event.set()

    # -- running a job -------------------------------------------------------------------------

    async def _run_job(self, held: _Held) -> None:
        job = held.job
        try:
            if self.draining.is_set():
                await self._release(held, "released before start: draining")
                return
            handler = self.w.handlers.get(job.type)
            if handler is None:  # cannot happen: the claim routes by our types
                await self._report_fail(held, "permanent", f"no handler for {job.type!r}",
                                        "UnknownJobType")
                return
            held.started = True
            outcome: tuple[str, Any] | None = None
            with held.scope:
                try:
                    result = await _invoke(handler, job, self.is_async[job.type])
                    outcome = ("complete", result)
                except Snooze as snooze:
                    outcome = ("snooze", snooze.seconds)
                except PermanentError as exc:
                    outcome = ("permanent", exc)
                except Exception as exc:
                    outcome = ("retryable", exc)
            if held.scope.cancelled_caught and held.cancel_reason is None:
                outcome = ("timeout", None)
            if outcome is None:
                await self._after_cancel(held)
                return
            kind, value = outcome
            if kind == "complete":
                self._free_slot_once(held)
                try:  # the common case: room in the channel, no scopes to enter
                    self.completions_in.send_nowait((held, value))
                except trio.WouldBlock:
                    with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT):
                        await self.completions_in.send((held, value))
                return
            if kind == "snooze":
                await self._report_snooze(held, float(value))
            elif kind == "timeout":
                await self._report_fail(held, "timeout",
                                        "handler ran past its deadline", "Timeout")
            else:
                await self._report_fail(held, kind, _describe(value), type(value).__name__)
        finally:
            job._mark_cancelled()
            self._free_slot_once(held)

    def _free_slot_once(self, held: _Held) -> None:
        if not held.slot_freed:
            held.slot_freed = True
            self._free_slot()

    async def _after_cancel(self, held: _Held) -> None:
        job = held.job
        job._mark_cancelled()
        reason = held.cancel_reason
        if reason == "lost":
            self.w.stats.lost_leases += 1
            self.held.pop(job.id, None)
            log.warning("lease lost: handler cancelled, result discarded",
                        extra={"job": job.id, "fence": job.fence})
        elif reason == "cancel_requested":
            await self._report_fail(held, "retryable", "cancelled by request", "Cancelled")
        else:  # drain (or an outer cancel): hand the job back without using an attempt
            await self._release(held, "released: drain timeout")

    # -- reports -------------------------------------------------------------------------------

    async def _complete_loop(self) -> None:
        self._flush_done = trio.Event()
        try:
            async with self.completions_out:
                while True:
                    try:
                        first = await self.completions_out.receive()
                    except trio.EndOfChannel:
                        return
                    batch = [first]
                    while True:
                        try:
                            batch.append(self.completions_out.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    await self._flush(batch)
        finally:
            self._flush_done.set()

    _flush_done: trio.Event

    async def _flush(self, batch: list[tuple[_Held, Any]]) -> None:
        ids = [h.job.id for h, _ in batch]
        fences = [h.job.fence for h, _ in batch]
        results = [r for _, r in batch]
        outcomes: list[calls.JobOutcome] | None = None
        with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT * 3):
            outcomes = await self.report_link.call(
                lambda c: calls.complete(c, self.worker_id, ids, fences, results))
        if outcomes is None:
            # The database did not answer in time (the link retries a lost connection for
            # ever). Stop holding these jobs: their leases lapse and they run again, as
            # after any lost report.
            log.warning("completions not reported: the database did not answer",
                        extra={"jobs": ids})
            for held, _ in batch:
                self.held.pop(held.job.id, None)
            return
        for (held, _), out in zip(batch, outcomes, strict=True):
            if out.outcome == "ok":
                self.w.stats.completed += 1
            else:
                self.w.stats.fenced += 1
            await self._flush_logs(held)
            self.held.pop(held.job.id, None)
        self.wake.set()  # local completions free cap room

    async def _report_one(self, held: _Held, stat: str,
                          call: Callable[[Any], Awaitable[str]],
                          bound: float = CLEANUP_TIMEOUT * 3) -> str | None:
        """Send one job's report (shielded, bounded), count it, flush its logs, let it go.

        ``call`` returns the engine's outcome; ``fenced`` is counted as such, anything else
        under ``stat``. Returns the outcome, or None when the database did not answer.
        """
        outcome: str | None = None
        with trio.CancelScope(shield=True), trio.move_on_after(bound):
            outcome = await self.report_link.call(call)
            if outcome == "fenced":
                self.w.stats.fenced += 1
            else:
                setattr(self.w.stats, stat, getattr(self.w.stats, stat) + 1)
            await self._flush_logs(held)
        self.held.pop(held.job.id, None)
        return outcome

    async def _report_fail(self, held: _Held, kind: str, message: str,
                           error_class: str) -> None:
        job = held.job

        async def fail(c: Any) -> str:
            out = await calls.fail(c, self.worker_id, job.id, job.fence, kind,
                                   message[:4000], error_class)
            return out.outcome

        await self._report_one(held, "failed", fail)

    async def _report_snooze(self, held: _Held, seconds: float) -> None:
        job = held.job

        async def snooze(c: Any) -> str:
            out = await calls.snooze(c, self.worker_id, job.id, job.fence, seconds)
            return out.outcome

        await self._report_one(held, "snoozed", snooze)

    async def _release(self, held: _Held, why: str) -> None:
        job = held.job

        async def release(c: Any) -> str:
            outs = await calls.release(c, self.worker_id, [job.id], [job.fence])
            return outs[0].outcome if outs else "ok"

        outcome = await self._report_one(held, "released", release, CLEANUP_TIMEOUT)
        if outcome not in (None, "fenced"):
            log.info(why, extra={"job": job.id, "fence": job.fence})

    async def _flush_logs(self, held: _Held) -> None:
        lines = held.job.take_logs()
        if not lines:
            return
        job = held.job
        await self.report_link.call(lambda c: calls.append_logs(
            c, self.worker_id, job.id, job.fence, [x[0] for x in lines],
            [x[1] for x in lines], [x[2] for x in lines]))

    # -- heartbeat -----------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = self.w.lease / 3
        while True:
            await trio.sleep(interval)
            await self.heartbeat()

    async def heartbeat(self) -> None:
        """Extend every lease held, flush logs, and stop the handlers whose job moved on."""
        held = list(self.held.values())
        if not held:
            await self.report_link.call(lambda c: calls.worker_heartbeat(c, self.worker_id))
            return
        ids = [h.job.id for h in held]
        fences = [h.job.fence for h in held]
        progress = [h.job._progress for h in held]
        attention = await self.report_link.call(lambda c: calls.extend_leases(
            c, self.worker_id, ids, fences, self.w.lease, progress))
        by_id = {h.job.id: h for h in held}
        for out in attention:
            h = by_id.get(out.job_id)
            if h is None or out.fence != h.job.fence:
                continue
            if out.outcome == "fenced":
                h.cancel_reason = "lost"
                h.scope.cancel()
                h.job._mark_cancelled()
            elif out.outcome == "cancel_requested" and h.cancel_reason is None:
                h.cancel_reason = "cancel_requested"
                h.scope.cancel()
                h.job._mark_cancelled()
        for h in held:
            if h.job._logs and h.job.id in self.held:
                await self._flush_logs(h)


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _invoke(handler: Handler, job: Job, is_async: bool) -> Any:
    if is_async:
        return await handler(job)
    # A sync handler runs in a thread; on cancel the thread is abandoned and
    # job.cancelled is set so a cooperative handler can stop. Made here, before the thread
    # starts, so that the thread and the runtime share one Event.
    job.cancelled  # noqa: B018
    return await trio.to_thread.run_sync(handler, job, abandon_on_cancel=True)

def _wall_to_trio() -> float:
    """What to add to a POSIX timestamp to get the Trio clock reading of that instant."""
    return trio.current_time() - time.time()


def _trio_time_of(when: dt.datetime) -> float:
    """The Trio clock reading at wall-clock instant ``when``."""
    return _wall_to_trio() + when.timestamp()


def _describe(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text or type(exc).__name__
