"""python -m bench {all,burndown,steady,idle,list} [--smoke] ...

Runs fenceline's peers (and fenceline, once its adapter exists) side by side on the same
PostgreSQL, each in a fresh database of its own, and prints and saves the results. See
docs/BENCHMARKS.md for the method and the latest figures.

Exit status: 0 when every available peer ran; 1 when the harness or an adapter broke (a
peer whose venv cannot be built, or whose adapter exits 3, is reported as not available
and does not fail the run); 2 for a usage error or a workload that is not built yet.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import engine_workloads, harness, http_workload, peers, workloads
from bench.harness import Postgres, log


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = ["all", "list", *workloads.WORKLOADS]
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[2])
    parser.add_argument("workload", choices=names, help="what to run ('list' shows them all)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few hundred jobs, short durations, one repetition (CI)",
    )
    parser.add_argument(
        "--peers",
        default=",".join(peers.PEERS),
        help="comma-separated peers (default: %(default)s)",
    )
    parser.add_argument("--baseline", default="pgqueuer", help="ratios are against this peer")
    parser.add_argument(
        "--dsn",
        default=os.environ.get("BENCH_DSN", harness.DEFAULT_DSN),
        help="maintenance database; peers get their own databases beside it "
        "(env BENCH_DSN; default %(default)s)",
    )
    parser.add_argument("--repeat", type=int, help="repetitions per workload (override)")
    parser.add_argument("--jobs", type=int, help="burn-down job count (override)")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        help="max seconds to wait for a quiet host before each run (default 15, smoke 0)",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        help="where JSON results go (default bench/results, smoke: bench/results/smoke)",
    )
    parser.add_argument("--seed", type=int, help="seed for the run order shuffle")
    parser.add_argument(
        "--caps-server",
        choices=engine_workloads.CAPS_SERVERS,
        help="caps: 'own' (default) starts a scratch PostgreSQL with max_connections 300 on "
        "fenceline's embedded binaries, so 128 claimers fit; 'shared' uses --dsn's server "
        "(claimer counts that do not fit its free connections are not measured)",
    )
    return parser.parse_args(argv)


def list_workloads() -> None:
    for wl in workloads.WORKLOADS.values():
        state = "built" if wl.built else "planned"
        print(f"{wl.name:12} {state:8} {wl.description}")


def header(machine: dict[str, Any], commit_ms: float | None, smoke: bool) -> list[str]:
    pgs = machine["postgres"]
    return [
        "fenceline benchmarks" + (" (SMOKE: tiny sizes, figures mean nothing)" if smoke else ""),
        f"machine: {machine['cores_logical']} cores ({machine['cpu_model']}), "
        f"{machine['memory_gib']} GiB, {machine['os']}, load avg {machine['load_avg_1_5_15']}",
        f"postgres: {pgs['server_version']}; shared_buffers {pgs['shared_buffers']}, "
        f"synchronous_commit {pgs['synchronous_commit']}, fsync {pgs['fsync']}, "
        f"max_connections {pgs['max_connections']}, wal_sync_method {pgs['wal_sync_method']}, "
        f"autovacuum {pgs['autovacuum']}; "
        f"INSERT+COMMIT round trip median {commit_ms} ms",
        f"harness: python {machine['harness_python']}, "
        + ", ".join(f"{k} {v}" for k, v in machine["harness_packages"].items()),
        "method: a fresh database and the peer's schema per run; burn-down jobs are "
        "inserted, then ANALYZE; CHECKPOINT; a wait for a quiet host; the worker starts "
        "and the clock runs from its 'ready' line until a probe sees nothing queued or "
        "running. CPU by psutil (worker; PG = the peer database's backends + checkpointer, "
        "bgwriter, walwriter); WAL by pg_waldump, this database's records only; commits by "
        "pg_stat_database (probe queries subtracted). The host is shared: compare ratios "
        "within one run.",
    ]


def peer_lines(ready: dict[str, peers.Peer]) -> list[str]:
    out = []
    for peer in ready.values():
        info = peer.info
        versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
        out.append(f"peer {peer.name}: {versions}")
        out.append("  settings: " + "; ".join(f"{k}={v}" for k, v in info["settings"].items()))
        out.extend(f"  source: {s}" for s in info.get("sources", []))
    return out


def main(argv: list[str] | None = None) -> int:
    assert engine_workloads.FENCELINE_ONLY  # imported for its register() calls
    assert http_workload.TARGET_RPS
    args = parse_args(argv)
    if args.workload == "list":
        list_workloads()
        return 0
    if args.workload == "all":
        selected = [wl for wl in workloads.WORKLOADS.values() if wl.built]
    else:
        wl = workloads.WORKLOADS[args.workload]
        if not wl.built:
            print(
                f"workload '{wl.name}' is planned, not built yet: {wl.description}", file=sys.stderr
            )
            return 2
        selected = [wl]
    wanted = [name.strip() for name in args.peers.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in peers.PEERS]
    if unknown:
        print(
            f"unknown peer(s): {', '.join(unknown)}; known: {', '.join(peers.PEERS)}",
            file=sys.stderr,
        )
        return 2

    started = time.monotonic()
    stamp = harness.utc_stamp()
    smoke: bool = args.smoke
    results_dir = args.results_dir or (
        harness.RESULTS_DIR / "smoke" if smoke else harness.RESULTS_DIR
    )
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    pg = Postgres(args.dsn)
    workdir = Path(tempfile.mkdtemp(prefix="fenceline-bench-"))
    scratch = f"bench_commitprobe_{os.getpid()}"
    ctx = workloads.Context(
        pg=pg,
        dsn=args.dsn,
        smoke=smoke,
        workdir=workdir,
        quiet_max_s=args.quiet_wait if args.quiet_wait is not None else (0.0 if smoke else 15.0),
        rng=random.Random(seed),
        wal_tools=pg.wal_tools(),
    )
    commit_probe: harness.CommitProbe | None = None
    broken = False
    pinned = harness.pin_fenceline_migrations(workdir)
    try:
        machine = harness.machine_info(pg)
        commit_probe = harness.CommitProbe(pg, scratch)
        ctx.commit_probe = commit_probe
        commit_ms = commit_probe.median_ms(50 if smoke else 200)
        for line in header(machine, commit_ms, smoke):
            log(line)
        log(
            f"fenceline schema: migrations/ of git {pinned} (the working tree's are being edited "
            "by others)"
            if pinned
            else "fenceline schema: the working tree's migrations/ (no git checkout here)"
        )

        ready: dict[str, peers.Peer] = {}
        unavailable: dict[str, str] = {}
        failed: dict[str, str] = {}
        for name in wanted:
            try:
                ready[name] = peers.prepare(peers.PEERS[name], log)
            except peers.PeerUnavailable as exc:
                unavailable[name] = str(exc)
            except peers.AdapterFailed as exc:
                failed[name] = str(exc)
        for line in peer_lines(ready):
            log(line)
        for name, why in unavailable.items():
            log(f"peer {name}: not available: {why}")
        for name, why in failed.items():
            log(f"peer {name}: FAILED: {why}")

        for wl in selected:
            assert wl.params is not None and wl.summarize is not None
            p = wl.params(smoke)
            if args.repeat:
                p["repeat"] = args.repeat
            if args.jobs and wl.name == "burndown":
                p["jobs"] = args.jobs
            if args.caps_server and wl.name == "caps":
                p["server"] = args.caps_server
            log(f"\n== {wl.name}: {wl.description}\n   parameters: {json.dumps(p)}")
            outcome = workloads.run_workload(ctx, wl, list(ready.values()), p)
            baseline = (
                args.baseline if args.baseline in outcome.runs else next(iter(outcome.runs), None)
            )
            if baseline != args.baseline:
                log(f"(baseline {args.baseline} has no runs here; ratios are against {baseline})")
            lines = wl.summarize(outcome.runs, baseline, p)
            all_unavailable = {**unavailable, **outcome.unavailable}
            all_failed = {**failed, **outcome.failed}
            for name in wanted:
                if name in all_unavailable:
                    lines.append(f"{name}: not available ({all_unavailable[name].splitlines()[0]})")
                elif name in all_failed:
                    lines.append(f"{name}: FAILED ({all_failed[name].splitlines()[0]})")
            for run_list in outcome.runs.values():
                for r in run_list:
                    if r.get("problems"):
                        lines.append(f"{r['peer']} rep {r['rep'] + 1}: " + "; ".join(r["problems"]))
                        broken = True
            noisy = workloads.noisy_runs(outcome.runs)
            if noisy:
                lines.append("noisy runs (other load > 0.3 cores): " + "; ".join(noisy))
            log("\n" + "\n\n".join(lines))
            path = harness.write_results(
                results_dir,
                stamp,
                wl.name,
                {
                    "workload": wl.name,
                    "description": wl.description,
                    "stamp": stamp,
                    "smoke": smoke,
                    "argv": sys.argv,
                    "seed": seed,
                    "parameters": p,
                    "concurrency": workloads.CONCURRENCY,
                    "machine": machine,
                    "commit_roundtrip_ms_at_start": commit_ms,
                    "commit_roundtrip_ms_note": "median INSERT+COMMIT, harness scratch database",
                    "baseline": baseline,
                    "peers": {
                        name: {
                            "status": "failed"
                            if name in all_failed
                            else "not available"
                            if name in all_unavailable
                            else "ok",
                            "reason": all_failed.get(name) or all_unavailable.get(name),
                            "info": ready[name].info if name in ready else None,
                            "pip_freeze": ready[name].freeze if name in ready else None,
                        }
                        for name in wanted
                    },
                    "order": outcome.order,
                    "runs": [r for rs in outcome.runs.values() for r in rs],
                    "table": lines,
                },
            )
            log(f"results: {path}")
            failed.update(outcome.failed)
            unavailable.update(outcome.unavailable)

        commit_end = commit_probe.median_ms(50 if smoke else 200)
        log(
            f"\nINSERT+COMMIT round trip: {commit_ms} ms at start, {commit_end} ms at end; "
            f"total {time.monotonic() - started:.0f} s"
        )
        for name, why in unavailable.items():
            log(f"not available: {name}: {why.splitlines()[0]}")
        if failed:
            broken = True
            for name, why in failed.items():
                log(f"FAILED: {name}: {why.splitlines()[0]}")
        if not any(r for r in failed) and not broken and len(unavailable) == len(wanted):
            log("warning: no peer could be measured")
    finally:
        for name in peers.PEERS:
            pg.drop_database(f"bench_{name}_{os.getpid()}")
        pg.drop_database(scratch)
        pg.close()
        if not broken:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"worker logs kept in {workdir}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
