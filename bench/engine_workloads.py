"""Workloads beyond the peer comparison: claim cost against table size (fenceline and
procrastinate), recovery after SIGKILL and the concurrency cap under contention (fenceline
alone).

Which peers, and why (printed with each table, and in docs/BENCHMARKS.md):

- claim-cost (fenceline and procrastinate): pgqueuer moves finished jobs out of its queue
  table (into pgqueuer_log), so its claim never sees history: no equivalent. procrastinate
  keeps finished jobs in procrastinate_jobs and is measured through its own fetch and finish
  SQL functions, the ones its worker calls.
- recovery: pgqueuer retries a job whose heartbeat is older than its retry timer, and
  procrastinate leaves stalled jobs to user code (`JobManager.get_stalled_jobs`); neither has
  an equivalent of a lease reaped by a separate scheduler, so there is nothing to compare.
- caps: fenceline's cap is a count of lease rows under a per-queue advisory transaction
  lock (docs/DECISIONS.md). It has no shard setting, so shards are "not applicable: single
  counter-free gate" and one configuration is measured. procrastinate has no concurrency cap;
  pgqueuer's per-entrypoint `concurrency_limit` is not compared here. By default it runs on a
  scratch PostgreSQL of its own (bench/own_server.py: fenceline's embedded binaries and
  launcher, max_connections 300, durable defaults), because 128 claimers do not fit in the
  shared server's max_connections 100; `--caps-server shared` runs it on --dsn's server.

Every run gets a fresh database set up by the peer's adapter (`setup`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench import harness
from bench.harness import fmt, fmt_spread, spread
from bench.own_server import own_server
from bench.peers import BENCH_DIR, AdapterFailed, Peer
from bench.workloads import Context, Workload, fresh_peer_db, register

FENCELINE_ONLY = ("fenceline",)
QUEUE_PATH = "bench/bench/bench"


def _connect(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


def _queue(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("select id from fl.queues where name = 'bench'").fetchone()
    assert row is not None, "the adapter's setup made no bench queue"
    return row[0]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ----------------------------------------------------------------------------- claim cost

# Terminal rows are a bench fixture inserted directly, with every trigger of the jobs table
# disabled for the insert and enabled again before anything is measured. fenceline: its
# jobs_birth trigger refuses a job born terminal and the FK triggers would check one queue row
# per job; the rows satisfy every CHECK constraint of fl.jobs (finished_at set exactly when
# terminal, no deadline). procrastinate: its triggers would write an event row per job.
FL_FILL_SQL = """
insert into fl.jobs (project_id, queue_id, type, payload, status, priority, run_at, fence,
                     attempts, timeout_ms, retry_policy_id, created_at, claimed_at, finished_at)
select q.project_id, q.id, 'noop', '{"ts": 0}',
       (case when g %% 50 = 0 then 'dead_letter' when g %% 100 = 1 then 'cancelled'
             else 'completed' end)::fl.job_status,
       0, t, 1, 1, 300000, q.retry_policy_id, t, t, t
  from fl.queues q,
       generate_series(%(lo)s::bigint, %(hi)s::bigint) g,
       lateral (select now() - interval '30 days' + g * interval '1 ms' as t) x
 where q.name = 'bench'
"""
PROC_FILL_SQL = """
insert into procrastinate_jobs (queue_name, task_name, priority, args, status, attempts)
select 'default', 'bench_noop', 0, '{"ts": 0}',
       (case when g %% 50 = 0 then 'failed' when g %% 100 = 1 then 'cancelled'
             else 'succeeded' end)::procrastinate_job_status, 1
  from generate_series(%(lo)s::bigint, %(hi)s::bigint) g
"""
FILL_BATCH = 1_000_000


@dataclass(frozen=True)
class ClaimOps:
    """How claim-cost drives one peer's own claim ("fetch") and completion SQL."""

    table: str
    claimable_index: str
    fill_sql: str
    ns: tuple[int, ...]  # claim sizes the peer's claim call takes
    register_sql: str
    queue_sql: str  # the queue the claims name (q)
    claim_sql: str  # params q, w, n; rows (id, token) of the jobs handed over
    held_sql: str  # param w: what the worker holds after an EXPLAINed claim
    complete: Callable[[psycopg.Connection[Any], Any, list[tuple[Any, Any]]], None]
    note: str


def _fl_complete(conn: psycopg.Connection[Any], w: Any, rows: list[tuple[Any, Any]]) -> None:
    conn.execute("select * from fl.complete(%s, %s, %s, %s::jsonb[])",
                 (w, [r[0] for r in rows], [r[1] for r in rows], [None] * len(rows)))


def _proc_complete(conn: psycopg.Connection[Any], w: Any,
                   rows: list[tuple[Any, Any]]) -> None:
    for job_id, _ in rows:
        conn.execute("select procrastinate_finish_job_v1(%s, 'succeeded', false)", (job_id,))


CLAIM_OPS: dict[str, ClaimOps] = {
    "fenceline": ClaimOps(
        table="fl.jobs",
        claimable_index="fl.jobs_claimable",
        fill_sql=FL_FILL_SQL,
        ns=(1, 16),
        register_sql="select fl.register_worker(array[(select id from fl.queues where name ="
        " 'bench')], array['noop'], 'bench', pg_backend_pid(), 16, null)",
        queue_sql="select id from fl.queues where name = 'bench'",
        claim_sql="select job_id, fence from fl.claim(%(q)s, %(w)s, array['noop'], %(n)s,"
        " interval '30 seconds') where outcome = 'ok'",
        held_sql="select job_id, fence from fl.leases where worker_id = %(w)s",
        complete=_fl_complete,
        note="fl.claim(queue, worker, {noop}, n, 30 s), then fl.complete",
    ),
    "procrastinate": ClaimOps(
        table="procrastinate_jobs",
        claimable_index="procrastinate_jobs_priority_idx_v1",
        fill_sql=PROC_FILL_SQL,
        ns=(1,),
        register_sql="select worker_id from procrastinate_register_worker_v1()",
        queue_sql="select null",  # all queues: what its worker asks for by default
        # procrastinate's fetch takes one job per call (ns = (1,)).
        claim_sql="select id, null from procrastinate_fetch_job_v2(null, %(w)s)"
        " where id is not null",
        held_sql="select id, null from procrastinate_jobs where worker_id = %(w)s"
        " and status = 'doing'",
        complete=_proc_complete,
        note="procrastinate_fetch_job_v2(all queues, worker) (what its worker calls: one job"
        " per call), then procrastinate_finish_job_v1(id, 'succeeded', false)",
    ),
}


def claim_cost_params(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"sizes": [10_000], "queued": 300, "claims": 100, "explains": 20, "vacuum": True,
                "repeat": 1}
    return {
        "sizes": [10_000, 100_000, 1_000_000, 10_000_000],
        "queued": 2_000,
        "claims": 500,
        "explains": 100,
        "vacuum": True,
        "repeat": 1,
    }


def _claim_and_complete(conn: psycopg.Connection[Any], ops: ClaimOps, qw: tuple[Any, Any],
                        n: int, explain: bool) -> tuple[float, dict[str, Any] | None, int]:
    q, w = qw
    args = {"q": q, "w": w, "n": n}
    t0 = time.perf_counter()
    if explain:
        plan = conn.execute(
            "explain (analyze, buffers, format json) " + ops.claim_sql, args  # type: ignore[operator]
        ).fetchone()[0][0]  # type: ignore[index]
        ms = (time.perf_counter() - t0) * 1000
        # EXPLAIN does not return the rows: complete what this worker holds instead.
        rows = conn.execute(ops.held_sql, args).fetchall()  # type: ignore[arg-type]
        node = plan["Plan"]
        info = {
            "exec_ms": plan["Execution Time"],
            "shared_hit": node["Shared Hit Blocks"],
            "shared_read": node["Shared Read Blocks"],
            "shared_dirtied": node["Shared Dirtied Blocks"],
        }
    else:
        rows = conn.execute(ops.claim_sql, args).fetchall()  # type: ignore[arg-type]
        ms = (time.perf_counter() - t0) * 1000
        info = None
    if rows:
        ops.complete(conn, w, [(r[0], r[1]) for r in rows])
    return ms, info, len(rows)


def _per_statement(conn: psycopg.Connection[Any], ops: ClaimOps, qw: tuple[Any, Any],
                   n: int) -> list[str]:
    """One claim (and its completion) with auto_explain logging every nested statement's
    plan and buffers to this client: where the blocks of a claim go, statement by statement.
    Superuser only (LOAD); returns [] when that is refused."""
    notices: list[str] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        if diag.message_primary:
            notices.append(diag.message_primary)

    try:
        conn.execute("load 'auto_explain'")
    except psycopg.Error:
        return []
    conn.add_notice_handler(keep)
    try:
        for setting in ("log_min_duration = 0", "log_nested_statements = on",
                        "log_analyze = on", "log_buffers = on", "log_timing = off"):
            conn.execute(f"set auto_explain.{setting}")  # type: ignore[arg-type]
        conn.execute("set client_min_messages = log")
        _claim_and_complete(conn, ops, qw, n, False)
    finally:
        conn.execute("reset client_min_messages")
        conn.execute("set auto_explain.log_min_duration = -1")
        conn.remove_notice_handler(keep)
    out = []
    for text in notices:
        lines = text.splitlines()
        query = next((ln[len("Query Text: "):].strip() for ln in lines
                      if ln.startswith("Query Text: ")), "?")
        buffers = next((ln.strip() for ln in lines if ln.strip().startswith("Buffers:")), "")
        scans = sorted({ln.strip().split("  (")[0].lstrip("-> ") for ln in lines
                        if " Scan " in ln or ln.strip().startswith("-> Bitmap")})
        out.append(f"{' '.join(query.split())[:60]!r}: {buffers or 'no buffers'}; "
                   f"{', '.join(scans)[:200]}")
    return out


def _submit(ctx: Context, peer: Peer, url: str, conn: psycopg.Connection[Any], k: int) -> None:
    """k queued no-op jobs, submitted the peer's normal way."""
    if peer.name == "fenceline":
        conn.execute("select fl.submit((select id from fl.queues where name = 'bench'),"
                     " 'noop', '{}') from generate_series(1, %s)", (k,))
    else:
        peer.run("enqueue", str(k), "--dsn", url, timeout=300)


def claim_cost_run(ctx: Context, peer: Peer, rep: int, p: dict[str, Any]) -> dict[str, Any]:
    ops = CLAIM_OPS[peer.name]
    db, url = fresh_peer_db(ctx, peer)
    steps = []
    problems: list[str] = []
    conn = _connect(url)
    try:
        have = 0
        for size in p["sizes"]:
            t0 = time.monotonic()
            conn.execute(f"alter table {ops.table} disable trigger all")  # type: ignore[arg-type]
            try:
                while have < size:
                    hi = min(size, have + FILL_BATCH)
                    conn.execute(ops.fill_sql, {"lo": have + 1, "hi": hi})  # type: ignore[arg-type]
                    have = hi
            finally:
                conn.execute(f"alter table {ops.table} enable trigger all")  # type: ignore[arg-type]
            fill_s = time.monotonic() - t0
            if not steps:
                # A standing backlog of queued jobs, submitted the normal way; each n
                # below adds what it will take, so the backlog is the same at every size.
                _submit(ctx, peer, url, conn, p["queued"])
            t1 = time.monotonic()
            # autovacuum is off on the shared server this was written on; without a VACUUM
            # the claimable index keeps a dead entry for every job claimed at the smaller
            # sizes, and that, not the table's size, is what later claims pay for (seen in
            # the first full run). VACUUM is what autovacuum would do here.
            vacuum_notes: list[str] = []

            def keep_vacuum_note(diag: psycopg.errors.Diagnostic,
                                 notes: list[str] = vacuum_notes) -> None:
                msg = diag.message_primary or ""
                notes.extend(ln.strip() for ln in msg.splitlines()
                             if ln.startswith("index scan") and "pg_toast" not in msg)

            conn.add_notice_handler(keep_vacuum_note)
            try:
                conn.execute(  # type: ignore[call-overload]
                    f"vacuum (analyze, verbose) {ops.table}" if p["vacuum"]
                    else f"analyze {ops.table}")
            finally:
                conn.remove_notice_handler(keep_vacuum_note)
            vacuum_s = time.monotonic() - t1
            if not ctx.smoke:
                ctx.pg.checkpoint()
            busy = harness.wait_quiet(ctx.quiet_max_s)
            # A new session per size, so no plan cached at a smaller size is reused.
            conn.close()
            conn = _connect(url)
            w = conn.execute(ops.register_sql).fetchone()[0]  # type: ignore[index, arg-type]
            qw = (conn.execute(ops.queue_sql).fetchone()[0], w)  # type: ignore[index, arg-type]

            def scalar(query: str, c: psycopg.Connection[Any] = conn) -> Any:
                return c.execute(query).fetchone()[0]  # type: ignore[index, arg-type]

            step: dict[str, Any] = {
                "rows": size,
                "standing_backlog": p["queued"],
                "fill_s": round(fill_s, 1),
                "vacuum_analyze_s": round(vacuum_s, 1),
                # VACUUM skips index cleanup when dead rows sit on < 2% of the heap's pages
                # ("index scan bypassed"): the claimable index then keeps the dead entries
                # of the jobs claimed since the last cleanup.
                "vacuum_index_note": vacuum_notes[:1],
                "claimable_index_pages": scalar(
                    f"select pg_relation_size('{ops.claimable_index}') / 8192"),
                "jobs_total_bytes": scalar(f"select pg_total_relation_size('{ops.table}')"),
                "jobs_heap_bytes": scalar(f"select pg_relation_size('{ops.table}')"),
                "host_busy_before_cores": busy,
                "commit_ms_before": ctx.commit_ms(),
                "load_avg": _load(),
            }
            for n in ops.ns:
                # What this n will take, on top of the standing backlog.
                _submit(ctx, peer, url, conn, (p["claims"] + p["explains"] + 6) * n)
                # Warm the session (plan caches) with a few claims, not measured.
                for _ in range(5):
                    _claim_and_complete(conn, ops, qw, n, False)
                lat = []
                handed = 0
                for _ in range(p["claims"]):
                    ms, _, got = _claim_and_complete(conn, ops, qw, n, False)
                    lat.append(ms)
                    handed += got
                infos = [
                    _claim_and_complete(conn, ops, qw, n, True)[1]
                    for _ in range(p["explains"])
                ]
                if handed < p["claims"] * n:
                    problems.append(f"{size} rows, n={n}: only {handed} jobs claimed")
                breakdown = _per_statement(conn, ops, qw, n)
                step[f"n{n}"] = {
                    "per_statement": breakdown,
                    "claim_ms": harness.latency_stats(lat),
                    "explain_exec_ms": spread(i["exec_ms"] for i in infos if i),
                    "shared_hit": spread(i["shared_hit"] for i in infos if i),
                    "shared_read": spread(i["shared_read"] for i in infos if i),
                    "shared_dirtied": spread(i["shared_dirtied"] for i in infos if i),
                }
            steps.append(step)
            harness.log(
                f"[claim-cost]   {peer.name} {size:,} rows: n=1 p50 "
                f"{step['n1']['claim_ms']['p50']:.2f} ms, "
                f"{step['n1']['shared_hit'].get('median')} hit / "
                f"{step['n1']['shared_read'].get('median')} read blocks (fill {fill_s:.0f} s,"
                f" vacuum {vacuum_s:.0f} s)"
            )
    finally:
        conn.close()
        ctx.pg.drop_database(db)
    return {"steps": steps, "problems": problems, "handled": len(steps), "load_avg": _load(),
            "claim_call": ops.note}


def claim_cost_summary(runs: dict[str, list[dict[str, Any]]], baseline: str | None,
                       p: dict[str, Any]) -> list[str]:
    if not runs:
        return ["Claim cost: no peer was measured."]
    headers = ["peer", "rows in jobs table", "jobs table", "claimable index pages", "n",
               "claim p50 ms", "p99 ms", "x smallest", "exec ms (EXPLAIN)", "shared hit",
               "shared read", "load avg"]
    rows = []
    detail = []
    for peer, rs in runs.items():
        steps = rs[-1]["steps"]
        ns = [int(k[1:]) for k in steps[0] if k.startswith("n") and k[1:].isdigit()] \
            if steps else []
        base = {n: steps[0][f"n{n}"]["claim_ms"]["p50"] for n in ns}
        for s in steps:
            for n in ns:
                m = s[f"n{n}"]
                rows.append([
                    peer,
                    f"{s['rows']:,}",
                    f"{s['jobs_total_bytes'] / 2**20:,.0f} MB",
                    str(s.get("claimable_index_pages", "-")),
                    str(n),
                    fmt(m["claim_ms"]["p50"], 2),
                    fmt(m["claim_ms"]["p99"], 2),
                    harness.ratio(m["claim_ms"]["p50"], base[n]),
                    fmt_spread(m["explain_exec_ms"], 3),
                    fmt_spread(m["shared_hit"]),
                    fmt_spread(m["shared_read"]),
                    " ".join(str(x) for x in s["load_avg"]),
                ])
        for s in (steps[0], steps[-1]) if len(steps) > 1 else steps[:1]:
            lines = s["n1"].get("per_statement") or []
            # The claim's own statements come before its Function Scan line; the rest is
            # the completion.
            end = next((i for i, ln in enumerate(lines) if "Function Scan on" in ln
                        and ("fl.claim(" in ln or "fetch_job" in ln)), len(lines) - 1)
            note = "; ".join(s.get("vacuum_index_note") or []) or "-"
            detail.append(f"{peer}: one n=1 claim at {s['rows']:,} rows, statement by "
                          f"statement (auto_explain); VACUUM before it said: {note}")
            detail.extend(f"    {ln}" for ln in lines[: end + 1])
    calls = "; ".join(f"{peer}: {rs[-1].get('claim_call', '?')}" for peer, rs in runs.items())
    return [
        "Claim cost against table size (fenceline and procrastinate; pgqueuer moves finished "
        f"jobs out of its queue table, so it has no equivalent). {p['queued']:,} queued jobs "
        "beside N terminal rows (98% completed/succeeded, 1% dead_letter/failed, 1% "
        "cancelled; a fixture inserted with the jobs table's triggers disabled, then "
        "re-enabled), then "
        + ("VACUUM (ANALYZE) of the jobs table" if p.get("vacuum") else "ANALYZE only")
        + f". A new connection per size; per claim size n: {p['claims']} x (claim, then "
        "complete), client round trip of the claim; then "
        f"{p['explains']} claims under EXPLAIN (ANALYZE, BUFFERS) for the blocks the whole "
        f"call touched (median (min-max)). Calls: {calls}.",
        harness.table(headers, rows, right=set(range(1, len(headers) - 1))),
        *(["\n".join(detail)] if detail else []),
    ]


# ----------------------------------------------------------------------------- recovery


def recovery_params(smoke: bool) -> dict[str, Any]:
    common = {"victims": 4, "victim_concurrency": 4, "jobs": 16, "reaper_interval_s": 1.0}
    if smoke:
        return {**common, "lease_s": 2.0, "retry_base_ms": [1000], "repeat": 1}
    return {**common, "lease_s": 5.0, "retry_base_ms": [1000, 0], "repeat": 1}


class _Proc:
    """A `fenceline run` process (via bench/fenceline_run.py, for the pinned schema) with its
    output in a file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._f = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH_DIR / "fenceline_run.py"), "--log-format", "json", *args],
            stdout=self._f, stderr=subprocess.STDOUT, cwd=BENCH_DIR.parent,
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._f.close()

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._f.close()


def _wait_for(cond: Any, timeout: float, what: str, interval: float = 0.02) -> float:
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return time.time()
        if time.monotonic() > deadline:
            raise AdapterFailed(f"recovery: {what} did not happen within {timeout:.0f} s")
        time.sleep(interval)


def _recovery_once(ctx: Context, peer: Peer, p: dict[str, Any], base_ms: int,
                   tag: str) -> dict[str, Any]:
    db, url = fresh_peer_db(ctx, peer)
    procs: list[_Proc] = []
    lease = p["lease_s"]
    try:
        with _connect(url) as conn:
            q = _queue(conn)
            conn.execute(
                "update fl.retry_policies set base_delay_ms = %s"
                " where id = (select retry_policy_id from fl.queues where id = %s)",
                (base_ms, q),
            )
            conn.execute(
                "select fl.submit(%s, 'sleep', '{\"ms\": 600000}') from generate_series(1, %s)",
                (q, p["jobs"]),
            )
            common = ["--database-url", url, "--drain-timeout", "1"]
            sched = _Proc([*common, "--roles", "scheduler", "--reaper-interval",
                           str(p["reaper_interval_s"])], ctx.workdir / f"{tag}-scheduler.log")
            procs.append(sched)
            victims = [
                _Proc([*common, "--roles", "worker", "--queue", QUEUE_PATH, "--concurrency",
                       str(p["victim_concurrency"]), "--lease", str(lease)],
                      ctx.workdir / f"{tag}-victim{i}.log")
                for i in range(p["victims"])
            ]
            procs.extend(victims)

            def held_by(n_workers: int) -> bool:
                row = conn.execute(
                    "select count(*), count(distinct l.worker_id) from fl.jobs j"
                    " join fl.leases l on l.job_id = j.id and l.fence = j.fence"
                    " where j.status = 'running'"
                ).fetchone()
                return row == (p["jobs"], n_workers)  # type: ignore[comparison-overlap]

            _wait_for(lambda: held_by(p["victims"]), 60, "16 jobs running on the victims")
            spare = _Proc([*common, "--roles", "worker", "--queue", QUEUE_PATH,
                           "--concurrency", "16", "--lease", str(lease)],
                          ctx.workdir / f"{tag}-spare.log")
            procs.append(spare)
            _wait_for(lambda: conn.execute(
                "select count(*) from fl.workers where state = 'active'"
            ).fetchone()[0] == p["victims"] + 1, 60, "the spare worker registering")  # type: ignore[index]
            # Let the heartbeats (every lease/3) fall at a random phase against the kill.
            time.sleep(lease / 3 * ctx.rng.random() + 0.5)
            before = {
                r[0]: (r[1], r[2])
                for r in conn.execute(
                    "select job_id, fence, extract(epoch from expires_at)::float8"
                    " from fl.leases").fetchall()
            }
            spare_id = conn.execute(
                "select id from fl.workers where pid = %s", (spare.proc.pid,)
            ).fetchone()
            t_kill = time.time()
            for v in victims:
                v.proc.send_signal(signal.SIGKILL)
            for v in victims:
                v.kill()
            t_all = _wait_for(
                lambda: conn.execute(
                    "select count(*) from fl.leases l join fl.jobs j on j.id = l.job_id"
                    " and j.fence = l.fence where j.status = 'running' and l.worker_id = %s",
                    (spare_id[0] if spare_id else None,),
                ).fetchone()[0] == p["jobs"],  # type: ignore[index]
                120, "every job running again on the spare worker", 0.01)
            rss = harness.peak_rss_mb(spare.proc.pid)
            per_job = conn.execute(
                "select a.job_id, extract(epoch from a.finished_at)::float8, a.outcome::text,"
                " extract(epoch from j.run_at)::float8, extract(epoch from j.claimed_at)::float8,"
                " j.fence, j.status::text"
                " from fl.attempts a join fl.jobs j on j.id = a.job_id"
                " where a.job_id = any(%s) and a.fence = (select f from unnest(%s::bigint[],"
                " %s::bigint[]) as x(i, f) where x.i = a.job_id)",
                (list(before), list(before), [v[0] for v in before.values()]),
            ).fetchall()
            dup = conn.execute(
                "select count(*) from fl.attempts where outcome = 'success'").fetchone()[0]  # type: ignore[index]
    finally:
        for proc in procs:
            proc.kill()
        ctx.pg.drop_database(db)
    jobs = []
    for job_id, reaped, outcome, run_at, claimed, fence, status in per_job:
        expires = before[job_id][1]
        jobs.append({
            "job": job_id,
            "old_outcome": outcome,
            "new_fence": fence,
            "status": status,
            "lease_expired_after_kill_s": expires - t_kill,
            "reaped_after_expiry_s": reaped - expires if reaped else None,
            "backoff_s": run_at - reaped if reaped else None,
            "claimed_after_kill_s": claimed - t_kill,
            "claimed_after_due_s": claimed - max(run_at, reaped or run_at),
        })

    def worst(key: str) -> float | None:
        vals = [j[key] for j in jobs if j[key] is not None]
        return max(vals) if vals else None

    problems = []
    if len(jobs) != p["jobs"] or any(j["old_outcome"] != "lost" for j in jobs):
        problems.append(f"expected {p['jobs']} lost attempts, saw "
                        f"{[j['old_outcome'] for j in jobs]}")
    if dup:
        problems.append(f"{dup} attempts completed (none should)")
    return {
        "retry_base_ms": base_ms,
        "lease_s": lease,
        "reaper_interval_s": p["reaper_interval_s"],
        "target_s": lease + p["reaper_interval_s"],
        "all_running_after_kill_s": t_all - t_kill,
        "last_claim_after_kill_s": worst("claimed_after_kill_s"),
        "worst_lease_expired_after_kill_s": worst("lease_expired_after_kill_s"),
        "worst_reaped_after_expiry_s": worst("reaped_after_expiry_s"),
        "worst_backoff_s": worst("backoff_s"),
        "worst_claimed_after_due_s": worst("claimed_after_due_s"),
        "spare_worker_peak_rss_mb": rss,
        "jobs": jobs,
        "problems": problems,
        "load_avg": _load(),
    }


def recovery_run(ctx: Context, peer: Peer, rep: int, p: dict[str, Any]) -> dict[str, Any]:
    configs = []
    for base_ms in p["retry_base_ms"]:
        r = _recovery_once(ctx, peer, p, base_ms, f"recovery-{rep}-{base_ms}")
        harness.log(
            f"[recovery]   retry base {base_ms} ms: every job running again "
            f"{r['all_running_after_kill_s']:.2f} s after SIGKILL (target {r['target_s']:.0f} s)"
        )
        configs.append(r)
    return {
        "configs": configs,
        "problems": [x for c in configs for x in c["problems"]],
        "handled": sum(len(c["jobs"]) for c in configs),
        "load_avg": _load(),
    }


def recovery_summary(runs: dict[str, list[dict[str, Any]]], baseline: str | None,
                     p: dict[str, Any]) -> list[str]:
    rs = runs.get("fenceline", [])
    if not rs:
        return ["Recovery: fenceline was not measured (adapter not available)."]
    headers = ["retry backoff", "all running again after kill s", "target (lease + reaper) s",
               "met", "lease expiry after kill s", "reaped after expiry s", "backoff s",
               "claimed after due s", "spare worker peak RSS MB", "load avg"]
    rows = []
    for r in rs:
        for c in r["configs"]:
            rows.append([
                "exponential, base 1 s, jitter (default)" if c["retry_base_ms"] == 1000
                else f"base {c['retry_base_ms']} ms",
                fmt(c["all_running_after_kill_s"], 2),
                fmt(c["target_s"], 0),
                "yes" if c["all_running_after_kill_s"] <= c["target_s"] else "no",
                fmt(c["worst_lease_expired_after_kill_s"], 2),
                fmt(c["worst_reaped_after_expiry_s"], 2),
                fmt(c["worst_backoff_s"], 2),
                fmt(c["worst_claimed_after_due_s"], 2),
                fmt(c["spare_worker_peak_rss_mb"], 0),
                " ".join(str(x) for x in c["load_avg"]),
            ])
    return [
        f"Recovery (fenceline only: no peer has a reaped lease to compare). {p['victims']} "
        f"`fenceline run --roles=worker --concurrency {p['victim_concurrency']} --lease "
        f"{p['lease_s']:g}` processes hold {p['jobs']} running `sleep` jobs and are SIGKILLed; "
        "a standby worker (concurrency 16, started before the kill) and a scheduler "
        f"(--roles=scheduler, reaper every {p['reaper_interval_s']:g} s, jittered to "
        "[interval/2, interval]) were already running. Seconds from the kill until all jobs "
        "run again on the standby; the other columns are the worst job's share, from the "
        "database's timestamps (lease expiry = last heartbeat + lease).",
        harness.table(headers, rows, right=set(range(1, len(headers) - 1))),
    ]


# ----------------------------------------------------------------------------- caps

AUDIT_SQL = """
create table bench_inflight_peak (peak integer not null);
insert into bench_inflight_peak values (0);
-- Its own settings: fl.claim runs with enable_seqscan off, which this tiny unindexed table
-- would inherit, and the resulting 1e10 cost estimate would JIT-compile the UPDATE (65 ms).
create function bench_inflight_audit() returns trigger language plpgsql
set enable_seqscan = on set jit = off as $$
begin
    update bench_inflight_peak
       set peak = greatest(peak, (select count(*) from fl.leases));
    return null;
end $$;
create trigger bench_inflight_audit after insert on fl.leases
    for each statement execute function bench_inflight_audit();
"""


# The own server's settings: enough connections for 128 claimers, the harness and the
# adapter's set-up; PostgreSQL's defaults otherwise (fsync, synchronous_commit on).
OWN_SERVER_OPTIONS = {"max_connections": "300"}
# Connections the caps run needs besides the claimers (harness, commit probe, setup, audit).
CAPS_HEADROOM = 8
CAPS_SERVERS = ("own", "shared")


def caps_params(smoke: bool) -> dict[str, Any]:
    # server "own": a scratch PostgreSQL the harness starts (bench/own_server.py) on the
    # binaries fenceline ships, with max_connections 300, because the shared server's 100
    # (shared with other people's test suites) cannot hold 128 claimers. It starts in about
    # a second, so the smoke run uses it too and keeps that path from rotting.
    # `--caps-server shared` runs on the harness's server instead (--dsn / BENCH_DSN); claimer
    # counts that do not fit in its free connections are reported as not measured.
    if smoke:
        return {"claimers": [4], "cap": 2, "seconds": 1.5, "hold_ms": 10, "jobs": 2_000,
                "repeat": 1, "server": "own", "own_server_options": OWN_SERVER_OPTIONS}
    return {"claimers": [16, 64, 128], "cap": 8, "seconds": 10.0, "hold_ms": 10,
            "jobs": 30_000, "repeat": 1, "server": "own",
            "own_server_options": OWN_SERVER_OPTIONS}


def _server_line(server: dict[str, Any]) -> str:
    st = server["settings"]
    keys = ("max_connections", "fsync", "synchronous_commit", "full_page_writes",
            "wal_sync_method", "shared_buffers", "wal_level", "jit")
    what = (f"own scratch PostgreSQL {st['server_version']} ({server['package']} binaries, "
            f"started by fenceline.db.embedded.run_embedded in {server['data_dir']}, "
            f"ready in {server['start_s']:g} s, -c "
            + " ".join(f"{k}={v}" for k, v in server["options"].items()) + ")"
            if server["kind"] == "own"
            else f"shared PostgreSQL {st['server_version']} ({server['dsn']})")
    return (what + "; " + ", ".join(f"{k} {st[k]}" for k in keys)
            + f"; INSERT+COMMIT round trip median {server['commit_ms']} ms")


def caps_run(ctx: Context, peer: Peer, rep: int, p: dict[str, Any]) -> dict[str, Any]:
    if p["server"] not in CAPS_SERVERS:
        raise AdapterFailed(f"caps: unknown server {p['server']!r} (own or shared)")
    if p["server"] == "shared":
        info = ctx.pg.conn.info
        server = {"kind": "shared", "dsn": f"{info.host}:{info.port}/{info.dbname}",
                  "settings": ctx.pg.settings(), "commit_ms": ctx.commit_ms()}
        harness.log(f"[caps] server: {_server_line(server)}")
        return _caps_runs(ctx, peer, p, server)
    with contextlib.ExitStack() as stack:
        try:
            srv = stack.enter_context(own_server(
                p["own_server_options"], keep_log_in=ctx.workdir,
                log=lambda m: harness.log(f"[caps] {m}")))
            pg = harness.Postgres(srv.dsn)
            stack.callback(pg.close)
            probe = harness.CommitProbe(pg, f"bench_commitprobe_{os.getpid()}")
        except (RuntimeError, OSError, psycopg.Error) as exc:
            raise AdapterFailed(f"caps: own PostgreSQL server did not start: {exc} "
                                "(--caps-server shared runs on the --dsn server)") from exc
        own = dataclasses.replace(ctx, pg=pg, dsn=srv.dsn, commit_probe=probe, wal_tools=None)
        server = {**srv.describe(), "settings": pg.settings(), "local": pg.local,
                  "commit_ms": probe.median_ms(50 if ctx.smoke else 200)}
        harness.log(f"[caps] server: {_server_line(server)}")
        return _caps_runs(own, peer, p, server)
    raise AssertionError("unreachable")


def _caps_runs(ctx: Context, peer: Peer, p: dict[str, Any],
               server: dict[str, Any]) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    problems: list[str] = []
    max_conn = int(ctx.pg.scalar("show max_connections"))
    for claimers in p["claimers"]:
        # Other people's sessions (on the shared server) count against max_connections too.
        in_use = int(ctx.pg.scalar("select count(*) from pg_stat_activity "
                                   "where backend_type = 'client backend'"))
        if claimers + CAPS_HEADROOM > max_conn - in_use:
            why = (f"not measured: {claimers} claimers + {CAPS_HEADROOM} do not fit in "
                   f"max_connections {max_conn} ({in_use} in use)")
            harness.log(f"[caps]   {claimers} claimers: {why}")
            results.append({"claimers": claimers, "skipped": why, "cap": p["cap"]})
            continue
        for audit in (False, True):
            db, url = fresh_peer_db(ctx, peer)
            try:
                with _connect(url) as conn:
                    q = _queue(conn)
                    conn.execute("update fl.queues set max_concurrency = %s where id = %s",
                                 (p["cap"], q))
                    conn.execute(
                        "select fl.submit(%s, 'noop', '{}') from generate_series(1, %s)",
                        (q, p["jobs"]))
                    conn.execute("analyze")
                    if audit:
                        conn.execute(AUDIT_SQL)  # type: ignore[arg-type]
                    busy = harness.wait_quiet(ctx.quiet_max_s)
                    commit_ms = ctx.commit_ms()
                    load0 = _load()
                    busy0, t0 = harness._busy_seconds(), time.monotonic()
                    proc = subprocess.run(
                        [sys.executable, str(BENCH_DIR / "claimers.py"), "--dsn", url,
                         "--queue", str(q), "--claimers", str(claimers), "--seconds",
                         str(p["seconds"]), "--hold-ms", str(p["hold_ms"])],
                        capture_output=True, text=True, timeout=p["seconds"] + 120,
                        cwd=BENCH_DIR.parent, check=False,
                    )
                    busy_during = (harness._busy_seconds() - busy0) / (time.monotonic() - t0)
                    if proc.returncode != 0:
                        raise AdapterFailed(f"claimers exited {proc.returncode}: "
                                            f"{proc.stderr.strip()[-500:]}")
                    out = json.loads(proc.stdout.strip().splitlines()[-1])
                    peak = conn.execute("select peak from bench_inflight_peak").fetchone()[0] \
                        if audit else None  # type: ignore[index]
                    leftover = conn.execute("select count(*) from fl.leases").fetchone()[0]  # type: ignore[index]
            finally:
                ctx.pg.drop_database(db)
            out.update(audit=audit, cap=p["cap"], db_peak_in_flight=peak,
                       leases_left=leftover, host_busy_before_cores=busy,
                       host_busy_cores_during=round(busy_during, 2),
                       commit_ms_before=commit_ms, load_avg_before=load0, load_avg=_load(),
                       server=server["kind"])
            if peak is not None and peak > p["cap"]:
                problems.append(f"{claimers} claimers: {peak} in flight > cap {p['cap']}")
            if out["client_max_held"] > p["cap"]:
                problems.append(f"{claimers} claimers: client saw {out['client_max_held']}"
                                f" held > cap {p['cap']}")
            harness.log(
                f"[caps]   {claimers} claimers{' (audit)' if audit else ''}: "
                f"{out['admissions_per_s']:.0f} admissions/s, claim p50 "
                f"{out['claim_ms_p50']:.1f} ms, peak in flight {peak}, cap {p['cap']}, "
                f"host busy {busy_during:.2f} cores, load {out['load_avg'][0]}"
            )
            results.append(out)
    return {"results": results, "problems": problems,
            "handled": len([r for r in results if "skipped" not in r]), "server": server,
            "load_avg": _load()}


def caps_summary(runs: dict[str, list[dict[str, Any]]], baseline: str | None,
                 p: dict[str, Any]) -> list[str]:
    rs = runs.get("fenceline", [])
    if not rs:
        return ["Caps: fenceline was not measured (adapter not available)."]
    headers = ["rep", "claimers", "in-flight audit", "admissions/s", "refusals/s (cap_full)",
               "claim p50 ms", "claim p99 ms", "peak in flight (DB)", "max held (client)",
               "cap", "claimers' CPU s", "host busy cores", "commit ms", "load avg"]
    rows = []
    skipped = []
    by_count: dict[int, list[dict[str, Any]]] = {}
    for r in rs:
        for o in r["results"]:
            if "skipped" in o:
                skipped.append(f"{o['claimers']} claimers: {o['skipped']}")
                continue
            by_count.setdefault(o["claimers"], []).append(o)
            rows.append([
                str(r["rep"] + 1),
                str(o["claimers"]),
                "on" if o["audit"] else "off",
                fmt(o["admissions_per_s"]),
                fmt(o["refusals"].get("cap_full", 0) / o["seconds"]),
                fmt(o["claim_ms_p50"], 1),
                fmt(o["claim_ms_p99"], 1),
                fmt(o["db_peak_in_flight"]) if o["audit"] else "-",
                str(o["client_max_held"]),
                str(o["cap"]),
                fmt(o["client_cpu_s"], 1),
                fmt(o.get("host_busy_cores_during"), 2),
                fmt(o["commit_ms_before"], 2),
                " ".join(str(x) for x in o["load_avg"]),
            ])
    # Per claimer count: throughput and latency from the runs without the audit, the peak
    # from the runs with it; median (min-max) over the repetitions.
    short_headers = ["claimers", "admissions/s", "refusals/s", "claim p50 ms", "claim p99 ms",
                     "peak in flight (exact)", "cap", "host busy cores", "load 1m"]
    short = []
    for n, os_ in sorted(by_count.items()):
        plain = [o for o in os_ if not o["audit"]]
        peaks = [o["db_peak_in_flight"] for o in os_ if o["audit"]]
        loads = [o["load_avg"][0] for o in os_]
        short.append([
            str(n),
            fmt_spread(spread(o["admissions_per_s"] for o in plain)),
            fmt_spread(spread(o["refusals"].get("cap_full", 0) / o["seconds"] for o in plain)),
            fmt_spread(spread(o["claim_ms_p50"] for o in plain), 1),
            fmt_spread(spread(o["claim_ms_p99"] for o in plain), 1),
            f"{max(peaks)} (max of {len(peaks)})" if peaks else "-",
            str(os_[0]["cap"]),
            fmt_spread(spread(o.get("host_busy_cores_during") for o in os_), 2),
            f"{min(loads)}-{max(loads)}",
        ])
    servers = sorted({_server_line(r["server"]) for r in rs if "server" in r})
    return [
        f"Caps under contention (fenceline only; shards: not applicable: single counter-free "
        f"gate, one configuration). max_concurrency {p['cap']}; each claimer is one "
        f"connection calling fl.claim(n=1), holding an admitted job {p['hold_ms']} ms, then "
        f"fl.complete; on a refusal it retries after 1-3 ms. {p['seconds']:g} s per run. "
        "'peak in flight (DB)' is exact: a bench-only statement trigger on fl.leases records "
        "the largest lease count any claim saw before committing (the gate's lock is held "
        "until then); runs with it on pay one extra UPDATE per claim, so admissions/s is "
        "taken from the runs without it. 'host busy cores': the whole host (2 cores here) "
        "while the claimers ran.",
        *(f"server: {line}" for line in servers),
        harness.table(headers, rows, right=set(range(0, len(headers) - 1)) - {2}),
        "Per claimer count, median (min-max) over the repetitions; throughput and latency "
        "from the runs without the audit, the peak from the runs with it:",
        harness.table(short_headers, short, right=set(range(0, len(short_headers) - 1))),
        *skipped,
    ]


register(Workload("claim-cost", "claim latency and blocks touched with 10k to 10M rows in "
                  "the jobs table, mostly terminal (fenceline, procrastinate)",
                  claim_cost_params, claim_cost_run, claim_cost_summary,
                  only=tuple(CLAIM_OPS)))
register(Workload("recovery", "SIGKILL of 4 workers holding 16 jobs: seconds until all run "
                  "again, against lease + reaper interval (fenceline only)", recovery_params,
                  recovery_run, recovery_summary, only=FENCELINE_ONLY))
register(Workload("caps", "max_concurrency under 16, 64 and 128 concurrent claimers: "
                  "admissions/s and peak in flight vs the cap, on a scratch server with "
                  "max_connections 300 (fenceline only)", caps_params,
                  caps_run, caps_summary, only=FENCELINE_ONLY))
