"""Burn-down sanity check of the engine's SQL: fl.claim and fl.complete, nothing else.

Method (the claim prototype's, reference/claim-prototype.md, minus the Trio worker):
- per run, a fresh database with every migrations/*.sql applied, one queue, one worker;
- N no-op jobs inserted in bulk, ANALYZE, CHECKPOINT (all untimed);
- one claimer connection calling fl.claim(queue, worker, types, 16, '30 s') in a loop and
  one completer connection calling fl.complete for whatever the claimer handed over since
  its last flush (no linger), each in its own thread with sync psycopg, autocommit;
- optionally a third connection that LISTENs on fl_queue, as every worker process has one
  (PostgreSQL runs a transaction in each listening backend per notifying commit);
- the clock runs from the first claim until the completer has completed every job.
Recorded per run: jobs/s, WAL bytes/job (pg_current_wal_lsn difference: use a server of
your own, it counts every database), commits/job (xact_commit + xact_rollback of the
database, read after the run's connections have closed so their statistics are flushed),
CPU seconds of the run's server backends per 1,000 jobs (psutil; the least load-sensitive
figure on a shared machine), claim round trip p50/p99.

Sync psycopg from Python threads is slower than the Trio worker the prototype measured
(the GIL, 115 us vs 38 us per round trip in reference/feasibility.md): read jobs/s as a
floor and WAL and commits per job as the schema's own cost.

    .venv/bin/python bench/sql_claim_smoke.py --runs 3
    .venv/bin/python bench/sql_claim_smoke.py --cap 16          # a binding cap
    .venv/bin/python bench/sql_claim_smoke.py --types noop,a,b  # the multi-type claim path
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

MIGRATIONS = Path(__file__).resolve().parents[1] / "migrations"
DEFAULT_DSN = "host=127.0.0.1 user=postgres dbname=postgres"
SETTINGS = (
    "server_version",
    "shared_buffers",
    "synchronous_commit",
    "fsync",
    "full_page_writes",
    "wal_level",
    "max_wal_size",
    "autovacuum",
)


def create_database(admin_dsn: str) -> tuple[str, str]:
    name = f"fl_smoke_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as c:
        c.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin_dsn, dbname=name)
    with psycopg.connect(dsn) as c:
        for path in sorted(MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.sql")):
            with c.transaction():
                c.execute(path.read_text())  # type: ignore[call-overload]
    return name, dsn


def drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as c:
        c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


STRIPPABLE = {
    # Experiments only: what an integrity device of the schema costs, measured by removing it
    # from a throwaway database. The migrations keep all of them.
    "guard": ["alter table fl.jobs disable trigger jobs_guard"],
    "fk": ["alter table fl.leases drop constraint leases_worker_id_fkey"],
    "checks": [
        "do $$ declare r record; begin for r in select conrelid::regclass as t, conname"
        " from pg_constraint where contype = 'c' and conrelid in"
        " ('fl.jobs'::regclass, 'fl.attempts'::regclass) loop"
        " execute format('alter table %s drop constraint %I', r.t, r.conname); end loop; end $$"
    ],
}


def setup(
    dsn: str,
    jobs: int,
    cap: int | None,
    types: list[str],
    fillfactor: int | None = None,
    strip: list[str] | None = None,
) -> tuple[str, str]:
    with psycopg.connect(dsn, autocommit=True) as c:
        for device in strip or []:
            for stmt in STRIPPABLE[device]:
                c.execute(stmt)  # type: ignore[call-overload]
        if fillfactor is not None:  # an experiment: the migrations' choice is the default
            c.execute(
                sql.SQL("alter table fl.jobs set (fillfactor = {})").format(sql.Literal(fillfactor))
            )
        org = c.execute(
            "insert into fl.organizations (name) values ('bench') returning id"
        ).fetchone()[0]  # type: ignore[index]
        proj = c.execute(
            "insert into fl.projects (org_id, name) values (%s, 'bench') returning id", (org,)
        ).fetchone()[0]  # type: ignore[index]
        pol = c.execute(
            "insert into fl.retry_policies (project_id, name) values (%s, 'default') returning id",
            (proj,),
        ).fetchone()[0]  # type: ignore[index]
        q = c.execute(
            "insert into fl.queues (project_id, name, retry_policy_id, max_concurrency)"
            " values (%s, 'bench', %s, %s) returning id",
            (proj, pol, cap),
        ).fetchone()[0]  # type: ignore[index]
        w = c.execute(
            "select fl.register_worker(array[%s::uuid], %s, 'bench', %s, 16)",
            (q, types, os.getpid()),
        ).fetchone()[0]  # type: ignore[index]
        c.execute(
            "insert into fl.jobs (project_id, queue_id, type, payload, run_at, timeout_ms,"
            " retry_policy_id) select %s, %s, %s, jsonb_build_object('n', g), now(), 300000, %s"
            " from generate_series(1, %s) g",
            (proj, q, types[0], pol, jobs),
        )
        c.execute("analyze")
        c.execute("checkpoint")
    return str(q), str(w)


# A reconstruction of the claim prototype's variant "a" (reference/claim-prototype.md: event
# per job, lease table, update in place; no cap, no FSM trigger, no FKs), from its sketch. It
# runs through the same Python loop in the same window, so the engine's figures can be read
# against it on a machine whose load changes from minute to minute.
BASELINE = """
create schema proto;
create table proto.jobs (id bigint generated always as identity primary key,
    queue_id int not null, type text not null, payload jsonb not null,
    status text not null default 'queued', priority int not null default 0,
    run_at timestamptz not null default now(), fence bigint not null default 0,
    attempt_count int not null default 0, worker_id uuid, claimed_at timestamptz,
    finished_at timestamptz);
create index on proto.jobs (queue_id, priority desc, run_at, id) where status = 'queued';
create table proto.attempts (job_id bigint, attempt int, fence bigint, worker_id uuid,
    started_at timestamptz, finished_at timestamptz, outcome text,
    primary key (job_id, attempt)) with (fillfactor = 50);
create table proto.leases (job_id bigint primary key, fence bigint, worker_id uuid,
    expires_at timestamptz);
create index on proto.leases (expires_at);
create table proto.events (id bigint generated always as identity primary key, topic text,
    entity_id bigint, payload jsonb, created_at timestamptz default now());
create function proto.claim(q int, w uuid, n int)
returns table (id bigint, fence bigint, attempt_count int, payload jsonb)
language plpgsql as $$
begin
    return query
    with c as (select j.id from proto.jobs j
                where j.queue_id = q and j.status = 'queued' and j.run_at <= now()
                order by priority desc, run_at, id limit n for update skip locked),
    u as (update proto.jobs j set status = 'running', fence = j.fence + 1,
                 attempt_count = j.attempt_count + 1, worker_id = w, claimed_at = now()
            from c where j.id = c.id returning j.id, j.fence, j.attempt_count, j.payload),
    a as (insert into proto.attempts select u.id, u.attempt_count, u.fence, w, now() from u),
    l as (insert into proto.leases select u.id, u.fence, w, now() + interval '30 s' from u)
    select * from u;
end $$;
create function proto.complete(ids bigint[], fences bigint[], w uuid)
returns table (id bigint, outcome text)
language plpgsql as $$
begin
    return query
    with inp as (select * from unnest(ids, fences) t(id, fence)),
    done as (update proto.jobs j set status = 'completed', finished_at = now()
               from inp where j.id = inp.id and j.fence = inp.fence and j.status = 'running'
             returning j.id, j.fence, j.attempt_count),
    att as (update proto.attempts a set finished_at = now(), outcome = 'success'
              from done where a.job_id = done.id and a.attempt = done.attempt_count),
    ls as (delete from proto.leases l using done where l.job_id = done.id),
    ev as (insert into proto.events (topic, entity_id, payload)
           select 'job.completed', done.id, '{}' from done)
    select inp.id, case when exists (select 1 from done where done.id = inp.id)
                        then 'ok' else 'fenced' end from inp;
    perform pg_notify('fl_queue', '1');
end $$;
"""


def setup_baseline(dsn: str, jobs: int) -> tuple[str, str]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(BASELINE)  # type: ignore[call-overload]
        c.execute(
            "insert into proto.jobs (queue_id, type, payload)"
            " select 1, 'noop', jsonb_build_object('n', g) from generate_series(1, %s) g",
            (jobs,),
        )
        c.execute("analyze")
        c.execute("checkpoint")
    return "1", "00000000-0000-0000-0000-000000000001"


def counters(c: psycopg.Connection[Any]) -> tuple[int, int]:
    c.execute("select pg_stat_clear_snapshot()")
    row = c.execute(
        "select pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,"
        " (select xact_commit + xact_rollback from pg_stat_database"
        "   where datname = current_database())"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def one_run(admin_dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    types = args.types.split(",")
    name, dsn = create_database(admin_dsn)
    try:
        if args.baseline:
            q, w = setup_baseline(dsn, args.jobs)
            claim_sql = "select id, fence from proto.claim(%(q)s::int, %(w)s::uuid, %(n)s)"
            complete_sql = (
                "select count(*) filter (where outcome = 'ok') from"
                " proto.complete(%(ids)s::bigint[], %(fences)s::bigint[], %(w)s::uuid)"
            )
        else:
            q, w = setup(
                dsn,
                args.jobs,
                args.cap,
                types,
                args.jobs_fillfactor,
                args.strip.split(",") if args.strip else None,
            )
            claim_sql = (
                "select job_id, fence from fl.claim(%(q)s, %(w)s, %(types)s, %(n)s, '30 seconds')"
                " where outcome = 'ok'"
            )
            complete_sql = (
                "select count(*) filter (where outcome = 'ok') from"
                " fl.complete(%(w)s, %(ids)s::bigint[], %(fences)s::bigint[])"
            )
        handoff: queue.Queue[tuple[int, int] | None] = queue.Queue()
        claim_ms: list[float] = []
        done = threading.Event()
        completed = 0
        errors: list[BaseException] = []

        claim_conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=args.prepare)
        complete_conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=args.prepare)
        listen_conn = psycopg.connect(dsn, autocommit=True) if args.listen else None
        if args.generic:
            for c in (claim_conn, complete_conn):
                c.execute("set plan_cache_mode = force_generic_plan")

        def claimer() -> None:
            try:
                claimed = 0
                while claimed < args.jobs:
                    t0 = time.perf_counter()
                    rows = claim_conn.execute(
                        claim_sql, {"q": q, "w": w, "types": types, "n": args.batch}
                    ).fetchall()
                    claim_ms.append((time.perf_counter() - t0) * 1000)
                    for r in rows:
                        handoff.put((r[0], r[1]))
                    claimed += len(rows)
                    if not rows:
                        time.sleep(0.0005)  # a binding cap: wait for completions
                handoff.put(None)
            except BaseException as exc:
                errors.append(exc)
                handoff.put(None)

        def completer() -> None:
            nonlocal completed
            try:
                finished = False
                while not finished:
                    item = handoff.get()
                    batch = []
                    while True:
                        if item is None:
                            finished = True
                            break
                        batch.append(item)
                        try:
                            item = handoff.get_nowait()
                        except queue.Empty:
                            break
                    if batch:
                        out = complete_conn.execute(
                            complete_sql,
                            {"w": w, "ids": [b[0] for b in batch], "fences": [b[1] for b in batch]},
                        ).fetchone()
                        assert out is not None and out[0] == len(batch), out
                        completed += len(batch)
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        def listener() -> None:
            assert listen_conn is not None
            listen_conn.execute("listen fl_queue")
            for _ in listen_conn.notifies(timeout=0.2, stop_after=None):
                pass
            while not done.is_set():
                for _ in listen_conn.notifies(timeout=0.2):
                    pass

        backends = [
            psutil.Process(c.info.backend_pid)
            for c in (claim_conn, complete_conn, listen_conn)
            if c is not None
        ]

        def backend_cpu() -> float:
            return sum(sum(p.cpu_times()[:2]) for p in backends)

        with psycopg.connect(dsn, autocommit=True) as probe:
            if args.walstats:
                probe.execute("create extension if not exists pg_walinspect")
            lsn0 = probe.execute("select pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
            wal0, commits0 = counters(probe)
            lt = threading.Thread(target=listener, daemon=True) if listen_conn else None
            if lt:
                lt.start()
                time.sleep(0.3)
            cpu0 = backend_cpu()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=claimer), threading.Thread(target=completer)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - t0
            if lt:
                lt.join(5)
            pg_cpu = backend_cpu() - cpu0
            for c in (claim_conn, complete_conn, listen_conn):
                if c is not None:
                    c.close()
            time.sleep(0.5)  # closed backends flush their statistics on exit
            wal1, commits1 = counters(probe)
            walstats = []
            if args.walstats:
                walstats = probe.execute(
                    'select "resource_manager/record_type", sum(count)::bigint,'
                    " sum(combined_size)::bigint, sum(fpi_size)::bigint"
                    " from pg_get_wal_stats(%s, pg_current_wal_lsn(), true)"
                    " where count > 0 group by 1 order by 3 desc",
                    (lsn0,),
                ).fetchall()
            if errors:
                raise errors[0]
            left = probe.execute(
                "select count(*) from proto.jobs where status <> 'completed'"
                if args.baseline
                else "select count(*) from fl.jobs where status <> 'completed'"
            ).fetchone()
            assert left is not None and left[0] == 0 and completed == args.jobs
        claim_ms.sort()
        return {
            "jobs_per_s": args.jobs / elapsed,
            "wal_bytes_per_job": (wal1 - wal0) / args.jobs,
            "commits_per_job": (commits1 - commits0) / args.jobs,
            "pg_cpu_s_per_1k": pg_cpu / args.jobs * 1000,
            "claim_ms_p50": claim_ms[len(claim_ms) // 2],
            "claim_ms_p99": claim_ms[int(len(claim_ms) * 0.99)],
            "claims": len(claim_ms),
            "wal_by_record": [
                {
                    "record": r[0],
                    "per_job": r[1] / args.jobs,
                    "bytes_per_job": r[2] / args.jobs,
                    "fpi_bytes_per_job": r[3] / args.jobs,
                }
                for r in walstats
            ],
        }
    finally:
        drop_database(admin_dsn, name)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dsn",
        default=os.environ.get("TEST_DATABASE_URL", DEFAULT_DSN),
        help="an admin DSN (creates and drops a database per run)",
    )
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cap", type=int, default=None, help="queue max_concurrency (default none)")
    p.add_argument("--types", default="noop", help="comma list the worker claims with")
    p.add_argument("--no-listen", dest="listen", action="store_false")
    p.add_argument("--generic", action="store_true", help="plan_cache_mode=force_generic_plan")
    p.add_argument(
        "--prepare",
        type=int,
        default=None,
        help="psycopg prepare_threshold (default None: never prepare)",
    )
    p.add_argument(
        "--jobs-fillfactor",
        type=int,
        default=None,
        help="experiment: override fl.jobs fillfactor before the bulk insert",
    )
    p.add_argument(
        "--walstats",
        action="store_true",
        help="WAL by record type (pg_walinspect, PostgreSQL 15+; a private server)",
    )
    p.add_argument(
        "--strip",
        default="",
        help="experiment: remove integrity devices first (comma list of: "
        + ", ".join(STRIPPABLE)
        + ")",
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help="run the reconstructed claim prototype 'a' instead of fl.* (same loop, same window)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()

    with psycopg.connect(args.dsn, autocommit=True) as c:
        settings = {
            k: c.execute(sql.SQL("show {}").format(sql.Identifier(k))).fetchone()[0]  # type: ignore[index]
            for k in SETTINGS
        }
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()},"
        f" {os.cpu_count()} CPUs, Python {platform.python_version()}, psycopg {psycopg.__version__}"
    )
    print("server: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(
        f"settings: {'BASELINE (prototype a) ' if args.baseline else ''}jobs={args.jobs}"
        f" batch={args.batch} cap={args.cap} types={args.types} strip={args.strip or '-'}"
        f" listen={args.listen} generic={args.generic} prepare={args.prepare}"
    )
    runs = []
    for i in range(args.runs):
        r = one_run(args.dsn, args)
        runs.append(r)
        print(
            f"run {i + 1}: {r['jobs_per_s']:,.0f} jobs/s, {r['wal_bytes_per_job']:,.0f} B WAL/job,"
            f" {r['commits_per_job']:.3f} commits/job, {r['pg_cpu_s_per_1k']:.3f} PG CPU s/1k jobs,"
            f" claim p50 {r['claim_ms_p50']:.2f} ms"
            f" p99 {r['claim_ms_p99']:.2f} ms ({r['claims']} claims)"
        )
        for rec in r["wal_by_record"]:
            print(
                f"    {rec['record']:<28} {rec['per_job']:6.2f}/job"
                f" {rec['bytes_per_job']:8.1f} B/job (FPI {rec['fpi_bytes_per_job']:.1f})"
            )

    def spread(key: str, fmt: str) -> str:
        vals = [r[key] for r in runs]
        return (
            f"{format(statistics.median(vals), fmt)}"
            f" ({format(min(vals), fmt)}-{format(max(vals), fmt)})"
        )

    print(
        f"median (min-max) of {len(runs)}: {spread('jobs_per_s', ',.0f')} jobs/s,"
        f" {spread('wal_bytes_per_job', ',.0f')} B WAL/job,"
        f" {spread('commits_per_job', '.3f')} commits/job,"
        f" {spread('pg_cpu_s_per_1k', '.3f')} PG CPU s/1k jobs,"
        f" claim p50 {spread('claim_ms_p50', '.2f')} ms"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "settings": vars(args) | {"json": str(args.json)},
                    "server": settings,
                    "runs": runs,
                },
                indent=2,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
