"""The `http-submit` workload: job submission through the HTTP API (fenceline only).

One run = a fresh database; a real `fenceline run --roles=api` (through
bench/fenceline_run.py, so the schema is the pinned one, and the migrator applies it on
start) with FENCELINE_PASSWORD_PROFILE=minimal (argon2's cheapest parameters: only the one
login of the set-up hashes a password, and login cost is not what is measured); an account,
organization, project, queue and a member-role API key created through the API itself; then
two closed-loop phases of `bench/http_clients.py` (16 keep-alive clients: 4 processes x 4
threads, http.client):

- single: `POST /api/v1/queues/{id}/jobs` with a small noop payload;
- batch: `POST /api/v1/queues/{id}/jobs/batch` with 100 noop jobs per request.

No worker runs: the jobs stay queued. Client, server and PostgreSQL share the host's cores,
so the client's own CPU and the server's are reported next to the figures. After each phase
the harness checks the database: one job row per job the clients were answered 2xx for, and
one audit row per such request (the audit row is written in the request's transaction).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench import harness
from bench.harness import Sampler, fmt, fmt_spread, spread
from bench.peers import BENCH_DIR, AdapterFailed, Peer
from bench.workloads import Context, Workload, register

TARGET_RPS = 1000.0
TARGET_P99_MS = 50.0


def http_params(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"procs": 1, "threads": 2, "seconds": 1.0, "warmup_s": 0.3, "batch_size": 10,
                "repeat": 1}
    return {"procs": 4, "threads": 4, "seconds": 20.0, "warmup_s": 2.0, "batch_size": 100,
            "repeat": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Api:
    """`fenceline run --roles=api` on a free port, its log in a file."""

    def __init__(self, url: str, log: Path, extra_env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.log = log
        self._f = log.open("w")
        env = {**os.environ, "DATABASE_URL": url, "FENCELINE_PASSWORD_PROFILE": "minimal",
               **(extra_env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH_DIR / "fenceline_run.py"), "--log-format", "json",
             "--roles=api", "--api-addr", "127.0.0.1", "--api-port", str(self.port)],
            stdout=self._f, stderr=subprocess.STDOUT, cwd=BENCH_DIR.parent, env=env)

    def request(self, method: str, path: str, body: Any = None,
                token: str | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            headers = {"Content-Type": "application/json"}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AdapterFailed(f"fenceline run --roles=api exited {self.proc.returncode}; "
                                    f"log {self.log}")
            try:
                if self.request("GET", "/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AdapterFailed(f"the API was not ready within {timeout:.0f} s; log {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._f.close()


def seed(api: Api) -> tuple[str, str]:
    """Account, organization, project, retry policy (defaults), queue and a member API key,
    all through the API."""
    def ok(answer: tuple[int, Any], what: str) -> Any:
        status, body = answer
        if status >= 300:
            raise AdapterFailed(f"seeding: {what} answered {status}: {body}")
        return body

    v1 = "/api/v1"
    email, password = "bench@example.com", "bench password 1234"
    ok(api.request("POST", f"{v1}/auth/register", {"email": email, "password": password}),
       "register")
    token = ok(api.request("POST", f"{v1}/auth/login", {"email": email, "password": password}),
               "login")["token"]
    org = ok(api.request("POST", f"{v1}/orgs", {"name": "bench"}, token), "org")["id"]
    project = ok(api.request("POST", f"{v1}/orgs/{org}/projects", {"name": "bench"}, token),
                 "project")["id"]
    policy = ok(api.request("POST", f"{v1}/projects/{project}/retry-policies",
                            {"name": "bench"}, token), "retry policy")["id"]
    queue = ok(api.request("POST", f"{v1}/projects/{project}/queues",
                           {"name": "bench", "retry_policy_id": policy}, token), "queue")["id"]
    key = ok(api.request("POST", f"{v1}/projects/{project}/api-keys",
                         {"name": "bench", "role": "member"}, token), "api key")["token"]
    return queue, key


def _phase(ctx: Context, api: Api, db: str, url: str, name: str, path: str, body: Any,
           per_request: int, p: dict[str, Any], key: str, workdir: Path) -> dict[str, Any]:
    body_file = workdir / f"{name}.json"
    body_file.write_text(json.dumps(body))
    busy = harness.wait_quiet(ctx.quiet_max_s)
    commit_ms = ctx.commit_ms()
    with psycopg.connect(url, autocommit=True) as conn:
        jobs0 = conn.execute("select count(*) from fl.jobs").fetchone()[0]  # type: ignore[index]
        audit0 = conn.execute("select count(*) from fl.audit_log where action like 'job.%'"
                              ).fetchone()[0]  # type: ignore[index]
    load0 = [round(x, 2) for x in os.getloadavg()]
    start = time.time() + 1.5
    w0 = start + p["warmup_s"]
    w1 = w0 + p["seconds"]
    client = subprocess.Popen(
        [sys.executable, str(BENCH_DIR / "http_clients.py"), "--port", str(api.port),
         "--path", path, "--token", key, "--body-file", str(body_file), "--procs",
         str(p["procs"]), "--threads", str(p["threads"]), "--start", repr(start), "--warmup",
         repr(p["warmup_s"]), "--seconds", repr(p["seconds"])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=BENCH_DIR.parent)
    sampler = Sampler(ctx.pg, db)
    time.sleep(max(0.0, w0 - time.time()))
    xact0 = ctx.pg.transactions(db)
    s0 = sampler.sample(api.proc.pid)
    time.sleep(max(0.0, w1 - time.time()))
    s1 = sampler.sample(api.proc.pid)
    xact1 = ctx.pg.transactions(db)
    load_mid = [round(x, 2) for x in os.getloadavg()]
    out, err = client.communicate(timeout=p["warmup_s"] + p["seconds"] + 300)
    if client.returncode != 0:
        raise AdapterFailed(f"http clients exited {client.returncode}: {err.strip()[-500:]}")
    res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    win = Sampler.window(s0, s1)
    seconds = win["window_s"]
    with psycopg.connect(url, autocommit=True) as conn:
        jobs1 = conn.execute("select count(*) from fl.jobs").fetchone()[0]  # type: ignore[index]
        audit1 = conn.execute("select count(*) from fl.audit_log where action like 'job.%'"
                              ).fetchone()[0]  # type: ignore[index]
    problems = []
    if jobs1 - jobs0 != res["ok_total"] * per_request:
        problems.append(f"{name}: {jobs1 - jobs0} jobs in the database, clients were answered "
                        f"2xx for {res['ok_total']} x {per_request}")
    if audit1 - audit0 != res["ok_total"]:
        problems.append(f"{name}: {audit1 - audit0} audit rows for {res['ok_total']} requests")
    client_cores = res["client_cpu_s"] / seconds
    other = win["other_load_cores"]
    res.update(
        phase=name, per_request=per_request, jobs_per_s=res["requests_per_s"] * per_request,
        server_cpu_cores=win["worker_cpu_s"] / seconds,
        pg_cpu_cores=(win["pg_cpu_s"] / seconds) if win["pg_cpu_s"] is not None else None,
        client_cpu_cores=client_cores,
        client_cpu_share=client_cores / (os.cpu_count() or 1),
        other_load_cores=None if other is None else round(other - client_cores, 3),
        xacts_per_request=(xact1 - xact0) / res["requests"] if res["requests"] else None,
        host_busy_before_cores=busy, commit_ms_before=commit_ms, load_avg_before=load0,
        load_avg_mid=load_mid, load_avg_after=[round(x, 2) for x in os.getloadavg()],
        problems=problems,
    )
    harness.log(
        f"[http-submit]   {name}: {res['requests_per_s']:,.0f} req/s "
        f"({res['jobs_per_s']:,.0f} jobs/s), p50 {res['latency_ms']['p50']:.1f} / p95 "
        f"{res['latency_ms']['p95']:.1f} / p99 {res['latency_ms']['p99']:.1f} ms, "
        f"errors {res['errors']}, server {res['server_cpu_cores']:.2f} cores, PG "
        f"{fmt(res['pg_cpu_cores'], 2)}, client {client_cores:.2f} cores, load {load_mid[0]}"
    )
    return res


def http_run(ctx: Context, peer: Peer, rep: int, p: dict[str, Any]) -> dict[str, Any]:
    db = f"bench_http_{os.getpid()}"
    ctx.pg.fresh_database(db)
    url = ctx.url(db)
    workdir = ctx.workdir / f"http-{rep}"
    workdir.mkdir(parents=True, exist_ok=True)
    api = Api(url, workdir / "api.log")
    try:
        api.wait_ready()
        queue, key = seed(api)
        single = _phase(ctx, api, db, url, "single", f"/api/v1/queues/{queue}/jobs",
                        {"type": "noop", "payload": {"n": 1}}, 1, p, key, workdir)
        n = p["batch_size"]
        batch = _phase(ctx, api, db, url, "batch", f"/api/v1/queues/{queue}/jobs/batch",
                       {"jobs": [{"type": "noop", "payload": {"n": i}} for i in range(n)]},
                       n, p, key, workdir)
        rss = harness.peak_rss_mb(api.proc.pid)
    finally:
        api.stop()
        ctx.pg.drop_database(db)
    return {"phases": [single, batch], "server_peak_rss_mb": rss,
            "problems": single["problems"] + batch["problems"],
            "handled": single["ok_total"] + batch["ok_total"] * n,
            "jobs_per_s": single["requests_per_s"],
            "latency_ms": single["latency_ms"],
            "other_load_cores": single["other_load_cores"]}


def http_summary(runs: dict[str, list[dict[str, Any]]], baseline: str | None,
                 p: dict[str, Any]) -> list[str]:
    rs = runs.get("fenceline", [])
    if not rs:
        return ["HTTP submission: fenceline was not measured (adapter not available)."]
    headers = ["phase", "rep", "req/s", "jobs/s", "p50 ms", "p95 ms", "p99 ms", "max ms",
               "errors", "server cores", "PG cores", "client cores (share of host)",
               "xacts/req", "load 1m"]
    rows = []
    for r in rs:
        for ph in r["phases"]:
            lat = ph["latency_ms"]
            rows.append([
                ph["phase"], str(r["rep"] + 1), fmt(ph["requests_per_s"]), fmt(ph["jobs_per_s"]),
                fmt(lat["p50"], 1), fmt(lat["p95"], 1), fmt(lat["p99"], 1), fmt(lat["max"], 1),
                str(ph["errors"]), fmt(ph["server_cpu_cores"], 2), fmt(ph["pg_cpu_cores"], 2),
                f"{ph['client_cpu_cores']:.2f} ({100 * ph['client_cpu_share']:.0f} %)",
                fmt(ph["xacts_per_request"], 2), str(ph["load_avg_mid"][0]),
            ])
    summary = []
    for phase in ("single", "batch"):
        phs = [ph for r in rs for ph in r["phases"] if ph["phase"] == phase]
        summary.append([
            phase,
            fmt_spread(spread(ph["requests_per_s"] for ph in phs)),
            fmt_spread(spread(ph["jobs_per_s"] for ph in phs)),
            fmt_spread(spread(ph["latency_ms"]["p50"] for ph in phs), 1),
            fmt_spread(spread(ph["latency_ms"]["p95"] for ph in phs), 1),
            fmt_spread(spread(ph["latency_ms"]["p99"] for ph in phs), 1),
            str(sum(ph["errors"] for ph in phs)),
        ])
    singles = [ph for r in rs for ph in r["phases"] if ph["phase"] == "single"]
    med_rps = spread(ph["requests_per_s"] for ph in singles).get("median", 0.0)
    med_p99 = spread(ph["latency_ms"]["p99"] for ph in singles).get("median", 1e9)
    met = med_rps >= TARGET_RPS and med_p99 < TARGET_P99_MS
    return [
        f"HTTP submission (fenceline only): `fenceline run --roles=api` (pool size default, "
        f"FENCELINE_PASSWORD_PROFILE=minimal: login cost is not measured), {p['procs']} x "
        f"{p['threads']} = {p['procs'] * p['threads']} keep-alive http.client clients "
        f"(processes x threads, closed loop), {p['warmup_s']:g} s warm-up then "
        f"{p['seconds']:g} s timed per phase; single = POST /queues/{{id}}/jobs, batch = POST "
        f"/queues/{{id}}/jobs/batch with {p['batch_size']} jobs per request. Client, server "
        "and PostgreSQL share the host's cores.",
        harness.table(headers, rows, right=set(range(1, len(headers)))),
        "Median (min-max) over the repetitions:\n" + harness.table(
            ["phase", "req/s", "jobs/s", "p50 ms", "p95 ms", "p99 ms", "errors"], summary,
            right=set(range(1, 7))),
        f"Target (single): >= {TARGET_RPS:,.0f} req/s with p99 < {TARGET_P99_MS:g} ms: "
        f"{'met' if met else 'NOT met'} (median {med_rps:,.0f} req/s, p99 {med_p99:.1f} ms).",
    ]


register(Workload("http-submit", "HTTP submission through the API: 16 keep-alive clients, "
                  "single jobs then batches of 100; req/s, jobs/s, p50/p95/p99 (fenceline "
                  "only)", http_params, http_run, http_summary, only=("fenceline",)))
