"""Workloads and their registry.

A workload is a function (ctx, peer, rep) -> one run's figures, plus a summary function that
turns the runs of every peer into printed tables. `python -m bench all` runs every built
workload in registry order; planned ones are listed (`python -m bench list`) and refuse to
run until someone plugs them in with @register.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench import harness
from bench.harness import Postgres, Probe, Sampler, fmt, fmt_spread, ratio, spread
from bench.peers import AdapterFailed, Peer, PeerUnavailable

CONCURRENCY = 16


@dataclass
class Context:
    pg: Postgres
    dsn: str
    smoke: bool
    workdir: Path
    quiet_max_s: float
    rng: random.Random = field(default_factory=random.Random)
    wal_tools: tuple[Path, Path] | None = None
    commit_probe: harness.CommitProbe | None = None

    def commit_ms(self) -> float | None:
        return self.commit_probe.median_ms(20) if self.commit_probe else None

    def dbname(self, peer: Peer) -> str:
        return f"bench_{peer.name}_{os.getpid()}"

    def url(self, dbname: str) -> str:
        return harness.url_for(self.dsn, dbname)


RunFn = Callable[[Context, Peer, int, dict[str, Any]], dict[str, Any]]
SummaryFn = Callable[[dict[str, list[dict[str, Any]]], str | None, dict[str, Any]], list[str]]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    params: Callable[[bool], dict[str, Any]] | None = None  # smoke -> parameters
    run: RunFn | None = None
    summarize: SummaryFn | None = None
    # Peers this workload measures (None: every peer); the others have no equivalent.
    only: tuple[str, ...] | None = None

    @property
    def built(self) -> bool:
        return self.run is not None


WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    WORKLOADS[workload.name] = workload
    return workload


# ----------------------------------------------------------------------------- one window


def fresh_peer_db(ctx: Context, peer: Peer) -> tuple[str, str]:
    db = ctx.dbname(peer)
    ctx.pg.fresh_database(db)
    url = ctx.url(db)
    peer.run("setup", "--dsn", url, timeout=300)
    return db, url


def worker_window(
    ctx: Context,
    peer: Peer,
    db: str,
    url: str,
    tag: str,
    during: Callable[[], dict[str, Any]] | None,
    drain_timeout: float,
    expected: int | None,
) -> dict[str, Any]:
    """Start the worker, measure from its `ready` line until the probe sees nothing queued or
    running, then stop it and read its start records.

    `during` runs right after `ready` (a producer, for the latency workloads).
    Commits are read after the worker's backends have gone (so their statistics are
    flushed), from a count taken before the worker started, less the probe's own queries.
    """
    ctx.pg.wait_database_idle(db)
    slot = ctx.pg.hold_wal() if ctx.wal_tools else None
    try:
        return _worker_window(ctx, peer, db, url, tag, during, drain_timeout, expected)
    finally:
        ctx.pg.release_wal(slot)


def _backend_cpu(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return float("nan")
    return float(t.user + t.system)


def _worker_window(
    ctx: Context,
    peer: Peer,
    db: str,
    url: str,
    tag: str,
    during: Callable[[], dict[str, Any]] | None,
    drain_timeout: float,
    expected: int | None,
) -> dict[str, Any]:
    probe = Probe(url, peer.info["remaining_sql"])
    sampler = Sampler(ctx.pg, db, exclude={probe.pid})
    records_path = ctx.workdir / f"{tag}.records.json"
    xact0 = ctx.pg.transactions(db)
    checkpoints0 = ctx.pg.checkpoints()
    t_spawn = time.monotonic()
    worker = peer.spawn(
        "work",
        "--dsn",
        url,
        "--concurrency",
        str(CONCURRENCY),
        "--records",
        str(records_path),
        stderr_path=ctx.workdir / f"{tag}.worker.stderr",
    )
    try:
        t_ready, line = worker.wait_line("ready", timeout=120)
        s0 = sampler.sample(worker.pid)
        probe_cpu0 = _backend_cpu(probe.pid)
        ready_wall = float(line.split()[1])
        extra = during() if during else {}
        drained, t_end = probe.wait_empty(drain_timeout)
        s1 = sampler.sample(worker.pid)
        probe_cpu = _backend_cpu(probe.pid) - probe_cpu0
        stall = None if drained else ctx.pg.activity(db)
        checkpoints = ctx.pg.checkpoints() - checkpoints0
        rss = harness.peak_rss_mb(worker.pid)
        t_stop = time.monotonic()
        result = worker.stop()
        stop_s = time.monotonic() - t_stop
    except BaseException:
        worker.kill()
        raise
    finally:
        probe.close()
    ctx.pg.wait_database_idle(db)
    xacts = ctx.pg.transactions(db) - xact0 - probe.queries
    window = Sampler.window(s0, s1)
    wal_server = window.pop("wal_bytes")
    wal_db = (
        harness.wal_of_database(ctx.wal_tools, s0.wal, s1.wal, ctx.pg.database_oid(db))
        if ctx.wal_tools
        else {"bytes": None, "error": "pg_waldump or pg_wal not readable here"}
    )
    records = json.loads(records_path.read_text())
    ids = [r[0] for r in records]
    out: dict[str, Any] = {
        **extra,
        **window,
        "wal_bytes": wal_db["bytes"] if wal_db["bytes"] is not None else wal_server,
        "wal_bytes_source": "pg_waldump, this database"
        if wal_db["bytes"] is not None
        else "pg_current_wal_lsn difference, whole server",
        "wal_bytes_server": wal_server,
        "wal_detail": wal_db,
        "checkpoints_in_window": checkpoints,
        "activity_at_timeout": stall,
        "startup_s": t_ready - t_spawn,
        "stop_s": stop_s,
        "drain_s": t_end - t_ready,
        "drained": drained,
        "handled": len(records),
        "duplicates": len(ids) - len(set(ids)),
        "commits": xacts,
        "probe_queries": probe.queries,
        # The probe's backend is left out of pg_cpu_s; its own cost is here so that a probe
        # that scans (and takes CPU from the worker on this 2-core host) shows.
        "probe_cpu_s": probe_cpu,
        "worker_peak_rss_mb": rss,
        "worker_self": {k: result.get(k) for k in ("cpu_s", "maxrss_mb")},
        "first_start_after_ready_ms": (
            (min(r[2] for r in records) - ready_wall) * 1000 if records else None
        ),
        "latencies_ms": [(r[2] - r[1]) * 1000 for r in records],
    }
    n = expected if expected is not None else len(records)
    if n:
        out["worker_cpu_s_per_1k"] = out["worker_cpu_s"] / n * 1000
        out["pg_cpu_s_per_1k"] = out["pg_cpu_s"] / n * 1000 if out["pg_cpu_s"] is not None else None
        out["pg_cpu_all_s_per_1k"] = (
            out["pg_cpu_all_s"] / n * 1000 if out["pg_cpu_all_s"] is not None else None
        )
        out["wal_bytes_per_job"] = out["wal_bytes"] / n
        if wal_db.get("full_page_image_bytes") is not None:
            out["wal_fpi_bytes_per_job"] = wal_db["full_page_image_bytes"] / n
        out["commits_per_job"] = xacts / n
    problems = []
    if not drained:
        problems.append(f"not drained after {drain_timeout:.0f} s")
    if expected is not None and len(records) != expected:
        problems.append(f"handled {len(records)} of {expected}")
    if out["duplicates"]:
        problems.append(f"{out['duplicates']} duplicate starts")
    out["problems"] = problems
    return out


# ----------------------------------------------------------------------------- burn-down


def burndown_params(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"jobs": 300, "repeat": 1, "drain_timeout_s": 120}
    return {"jobs": 20_000, "repeat": 3, "drain_timeout_s": 1800}


def burndown_run(ctx: Context, peer: Peer, rep: int, p: dict[str, Any]) -> dict[str, Any]:
    n = int(p["jobs"])
    t0 = time.monotonic()
    db, url = fresh_peer_db(ctx, peer)
    t1 = time.monotonic()
    enq = peer.run("enqueue", str(n), "--dsn", url, timeout=900)
    t2 = time.monotonic()
    ctx.pg.analyze_and_checkpoint(db, checkpoint=not ctx.smoke)
    t3 = time.monotonic()
    busy_before = harness.wait_quiet(ctx.quiet_max_s)
    commit_ms = ctx.commit_ms()
    phases = {
        "setup_s": t1 - t0,
        "enqueue_s": t2 - t1,
        "analyze_checkpoint_s": t3 - t2,
        "quiet_wait_s": time.monotonic() - t3,
    }
    out = worker_window(
        ctx, peer, db, url, f"burndown-{peer.name}-{rep}", None, p["drain_timeout_s"], n
    )
    out.pop("latencies_ms")
    out.update(
        jobs=n,
        enqueue_s=enq["seconds"],
        enqueue_wall_s=phases["enqueue_s"],
        phases_s=phases,
        enqueue_jobs_per_s=n / enq["seconds"] if enq["seconds"] else None,
        jobs_per_s=n / out["drain_s"] if out["drained"] else None,
        host_busy_before_cores=busy_before,
        commit_ms_before=commit_ms,
    )
    ctx.pg.drop_database(db)
    return out


BURNDOWN_COLUMNS: list[tuple[str, str, int]] = [
    # (run key, header, digits)
    ("jobs_per_s", "jobs/s median (min-max)", 0),
    ("enqueue_jobs_per_s", "enqueue jobs/s", 0),
    ("worker_cpu_s_per_1k", "worker CPU s/1k", 3),
    ("pg_cpu_s_per_1k", "PG CPU s/1k", 3),
    ("wal_bytes_per_job", "WAL B/job", 0),
    ("wal_fpi_bytes_per_job", "of which FPI", 0),
    ("commits_per_job", "commits/job", 3),
    ("worker_peak_rss_mb", "worker peak RSS MB", 0),
    ("commit_ms_before", "commit ms", 2),
    ("checkpoints_in_window", "ckpts", 0),
    ("probe_cpu_s", "probe CPU s", 2),
]


def burndown_summary(
    runs: dict[str, list[dict[str, Any]]], baseline: str | None, p: dict[str, Any]
) -> list[str]:
    stats = {
        peer: {k: spread(r.get(k) for r in rs) for k, _, _ in BURNDOWN_COLUMNS}
        for peer, rs in runs.items()
    }
    base = stats.get(baseline or "", {}).get("jobs_per_s", {})
    headers = ["peer", BURNDOWN_COLUMNS[0][1], f"x {baseline or '-'}", "slowest/fastest"]
    headers += [h for _, h, _ in BURNDOWN_COLUMNS[1:]] + ["load 1m", "runs"]
    rows = []
    for peer, s in stats.items():
        tp = s["jobs_per_s"]
        rows.append(
            [
                peer,
                fmt_spread(tp),
                ratio(tp.get("median"), base.get("median")),
                ratio(tp.get("min"), base.get("max")),
                *(fmt_spread(s[k], d) for k, _, d in BURNDOWN_COLUMNS[1:]),
                load_1m(runs[peer]),
                str(tp.get("n", 0)),
            ]
        )
    return [
        f"Burn-down: {p['jobs']:,} no-op jobs bulk-inserted (untimed for jobs/s), one worker "
        f"process, concurrency {CONCURRENCY}; median (min-max) of {p['repeat']} run(s) per peer, "
        "peers interleaved. 'slowest/fastest' = this peer's slowest run / the baseline's "
        "fastest run. Costs are per job over the drain window. 'commit ms' = median "
        "INSERT+COMMIT round trip just before the run (the shared disk's fsync); 'ckpts' = "
        "checkpoints (anyone's) during the window, each of which adds full-page images.",
        harness.table(headers, rows, right=set(range(1, len(headers)))),
    ]


# ----------------------------------------------------------------------------- latency


def latency_run(ctx: Context, peer: Peer, rep: int, p: dict[str, Any], name: str) -> dict[str, Any]:
    rate, seconds = float(p["rate"]), float(p["seconds"])
    db, url = fresh_peer_db(ctx, peer)
    # No ANALYZE here: the tables are empty, and statistics saying "empty" make a peer's
    # cached plans scan quadratically once jobs pile up (seen with procrastinate's fetch),
    # while autovacuum, which would re-analyze in production, is off on this shared server.
    # A fresh install has never-analyzed tables, which is what the peers expect.
    if not ctx.smoke:
        ctx.pg.checkpoint()
    busy_before = harness.wait_quiet(ctx.quiet_max_s)
    commit_ms = ctx.commit_ms()
    tag = f"{name}-{peer.name}-{rep}"

    def produce() -> dict[str, Any]:
        time.sleep(p["warmup_s"])  # let the worker finish its own start-up first
        producer = peer.spawn(
            "produce",
            "--dsn",
            url,
            "--rate",
            str(rate),
            "--seconds",
            str(seconds),
            stderr_path=ctx.workdir / f"{tag}.producer.stderr",
        )
        try:
            res = producer.wait(timeout=seconds + 120)
        except BaseException:
            producer.kill()
            raise
        return {"producer": res}

    expected = round(rate * seconds)
    out = worker_window(ctx, peer, db, url, tag, produce, p["drain_timeout_s"], expected)
    lat = out.pop("latencies_ms")
    out.update(
        rate_per_s=rate,
        seconds=seconds,
        latency_ms=harness.latency_stats(lat),
        host_busy_before_cores=busy_before,
        commit_ms_before=commit_ms,
    )
    ctx.pg.drop_database(db)
    return out


def steady_params(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"rate": 50, "seconds": 2, "repeat": 1, "warmup_s": 0.5, "drain_timeout_s": 60}
    return {"rate": 200, "seconds": 20, "repeat": 1, "warmup_s": 1.0, "drain_timeout_s": 600}


def idle_params(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"rate": 5, "seconds": 1.2, "repeat": 1, "warmup_s": 0.5, "drain_timeout_s": 60}
    return {"rate": 2, "seconds": 20, "repeat": 1, "warmup_s": 1.0, "drain_timeout_s": 60}


def latency_summary(
    runs: dict[str, list[dict[str, Any]]],
    baseline: str | None,
    p: dict[str, Any],
    title: str,
    cols: tuple[str, ...],
) -> list[str]:
    def lat(rs: list[dict[str, Any]], key: str) -> dict[str, Any]:
        return spread(r["latency_ms"].get(key) for r in rs)

    stats = {peer: {c: lat(rs, c) for c in (*cols, "max")} for peer, rs in runs.items()}
    ratio_cols = (cols[0], cols[-1])
    base = stats.get(baseline or "", {})
    headers = ["peer", "jobs", "submitted/s"] + [f"{c} ms" for c in (*cols, "max")]
    headers += [f"{c} x {baseline or '-'}" for c in ratio_cols] + ["commit ms", "load 1m", "runs"]
    rows = []
    for peer, s in stats.items():
        rs = runs[peer]
        rows.append(
            [
                peer,
                fmt(sum(r["handled"] for r in rs) / max(len(rs), 1)),
                fmt_spread(spread(r["producer"].get("achieved_rate_per_s") for r in rs), 1),
                *(fmt_spread(s[c], 1) for c in (*cols, "max")),
                *(ratio(s[c].get("median"), base.get(c, {}).get("median")) for c in ratio_cols),
                fmt_spread(spread(r.get("commit_ms_before") for r in rs), 2),
                load_1m(rs),
                str(len(rs)),
            ]
        )
    return [title, harness.table(headers, rows, right=set(range(1, len(headers))))]


def load_1m(rs: list[dict[str, Any]]) -> str:
    """The 1-minute load average as each run began (min-max over runs)."""
    return fmt_spread(spread((r.get("load_avg_before") or [None])[0] for r in rs), 2)


def steady_run(ctx: Context, peer: Peer, rep: int, p: dict[str, Any]) -> dict[str, Any]:
    return latency_run(ctx, peer, rep, p, "steady")


def idle_run(ctx: Context, peer: Peer, rep: int, p: dict[str, Any]) -> dict[str, Any]:
    return latency_run(ctx, peer, rep, p, "idle")


def steady_summary(
    runs: dict[str, list[dict[str, Any]]], baseline: str | None, p: dict[str, Any]
) -> list[str]:
    title = (
        f"Steady: one producer submits one job at a time at {p['rate']}/s for {p['seconds']} s "
        f"while one worker (concurrency {CONCURRENCY}) runs; submit-to-start latency (submit "
        "timestamp in the payload vs time.time() as the handler begins). 'submitted/s' is the "
        "rate the producer achieved (one INSERT+COMMIT per job, so it can fall short)."
    )
    return latency_summary(runs, baseline, p, title, ("p50", "p95", "p99"))


def idle_summary(
    runs: dict[str, list[dict[str, Any]]], baseline: str | None, p: dict[str, Any]
) -> list[str]:
    n = round(p["rate"] * p["seconds"])
    title = (
        f"Idle latency: one job every {1000 / p['rate']:.0f} ms, {n} jobs, on an otherwise idle "
        "worker; submit-to-start latency."
    )
    return latency_summary(runs, baseline, p, title, ("p50", "p99"))


register(
    Workload(
        "burndown",
        "bulk-insert N no-op jobs, one worker drains them; jobs/s and "
        "cost per job (CPU, WAL, commits, RSS)",
        burndown_params,
        burndown_run,
        burndown_summary,
    )
)
register(
    Workload(
        "steady",
        "one job at a time at 200/s for 20 s; submit-to-start p50/p95/p99",
        steady_params,
        steady_run,
        steady_summary,
    )
)
register(
    Workload(
        "idle",
        "one job every 500 ms, 40 jobs; submit-to-start p50/p99",
        idle_params,
        idle_run,
        idle_summary,
    )
)

# claim-cost, recovery and caps are in bench/engine_workloads.py (fenceline only), and
# http-submit in bench/http_workload.py.


# ----------------------------------------------------------------------------- driver


@dataclass
class Outcome:
    runs: dict[str, list[dict[str, Any]]]
    unavailable: dict[str, str]
    failed: dict[str, str]
    order: list[list[str]]


def run_workload(ctx: Context, wl: Workload, peers: list[Peer], p: dict[str, Any]) -> Outcome:
    """Run every repetition; within a repetition each peer once, in a shuffled order."""
    assert wl.run is not None
    runs: dict[str, list[dict[str, Any]]] = {peer.name: [] for peer in peers}
    unavailable: dict[str, str] = {}
    failed: dict[str, str] = {}
    order: list[list[str]] = []
    if wl.only is not None:
        skipped = [peer.name for peer in peers if peer.name not in wl.only]
        if skipped:
            harness.log(f"[{wl.name}] {', '.join(skipped)}: no equivalent workload, not run")
        peers = [peer for peer in peers if peer.name in wl.only]
    for rep in range(int(p["repeat"])):
        active = [peer for peer in peers if peer.name not in unavailable | failed]
        ctx.rng.shuffle(active)
        order.append([peer.name for peer in active])
        for peer in active:
            t0 = time.monotonic()
            load0 = [round(x, 2) for x in os.getloadavg()]
            harness.log(f"[{wl.name}] rep {rep + 1}/{p['repeat']} {peer.name} ... (load {load0})")
            try:
                run = wl.run(ctx, peer, rep, p)
            except PeerUnavailable as exc:
                unavailable[peer.name] = str(exc)
                harness.log(f"[{wl.name}] {peer.name}: not available: {exc}")
                continue
            except AdapterFailed as exc:
                failed[peer.name] = str(exc)
                harness.log(f"[{wl.name}] {peer.name}: FAILED: {exc}")
                continue
            run.update(
                peer=peer.name,
                rep=rep,
                wall_s=time.monotonic() - t0,
                load_avg_before=load0,
                load_avg_after=[round(x, 2) for x in os.getloadavg()],
            )
            runs[peer.name].append(run)
            harness.log(f"[{wl.name}]   {describe(run)}")
    return Outcome({k: v for k, v in runs.items() if v}, unavailable, failed, order)


def describe(run: dict[str, Any]) -> str:
    parts = []
    if run.get("jobs_per_s"):
        parts.append(f"{run['jobs_per_s']:,.0f} jobs/s")
    if "latency_ms" in run and run["latency_ms"].get("n"):
        lat = run["latency_ms"]
        parts.append(f"p50 {lat['p50']:.1f} ms p99 {lat['p99']:.1f} ms")
    parts.append(f"handled {run['handled']}")
    if run.get("commit_ms_before") is not None:
        parts.append(f"commit {run['commit_ms_before']:.2f} ms before")
    if run.get("other_load_cores") is not None:
        parts.append(f"other load {run['other_load_cores']:.2f} cores")
    parts.append(f"{run['wall_s']:.1f} s")
    if run.get("problems"):
        parts.append("PROBLEMS: " + "; ".join(run["problems"]))
    return ", ".join(parts)


def noisy_runs(runs: dict[str, list[dict[str, Any]]], threshold: float = 0.3) -> list[str]:
    out = []
    for peer, rs in runs.items():
        for r in rs:
            load = r.get("other_load_cores")
            if load is not None and not math.isnan(load) and load > threshold:
                out.append(f"{peer} rep {r['rep'] + 1}: {load:.2f} cores of other load")
    return out
