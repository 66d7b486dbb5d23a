"""Closed-loop HTTP clients for the `http-submit` workload: keep-alive POSTs, timed.

--procs processes, each with --threads threads; each thread holds one keep-alive
`http.client.HTTPConnection` and sends the same POST again as soon as the answer is read
(closed loop: at most procs x threads requests in flight). Threads are cheap here because a
thread waiting on its socket releases the GIL; several processes keep one GIL from holding
back answers that have already arrived (which would show as client-side latency).

Every process waits for the same wall-clock --start, runs --warmup seconds untimed (the
server's pool opens its connections then), then --seconds timed: a request counts when it
was sent inside the window. Latency is send to last byte of the answer read, in ms.

Prints one JSON line: requests and requests/s in the window, latency percentiles, status
counts, errors (transport errors and non-2xx answers), every 2xx answer sent at any time
(for the harness's row count check), and the client processes' own CPU seconds inside the
window (getrusage, all threads).

    .venv/bin/python bench/http_clients.py --port 3001 --path /api/v1/queues/Q/jobs \
        --token flk_... --body-file body.json --procs 4 --threads 4 --seconds 20
"""

from __future__ import annotations

import argparse
import http.client
import json
import resource
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--body-file", type=Path, required=True)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--start", type=float, help="wall-clock start (default: now + 1 s)")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(a: argparse.Namespace) -> dict[str, Any]:
    body = a.body_file.read_bytes()
    headers = {"Authorization": f"Bearer {a.token}", "Content-Type": "application/json"}
    w0 = a.start + a.warmup
    w1 = w0 + a.seconds
    lock = threading.Lock()
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    ok_total = [0]
    transport_errors: Counter[str] = Counter()

    def loop() -> None:
        conn = http.client.HTTPConnection(a.host, a.port, timeout=60)
        mine: list[float] = []
        st: Counter[str] = Counter()
        ok = 0
        errs: Counter[str] = Counter()
        while time.time() < a.start:
            time.sleep(0.001)
        while True:
            sent = time.time()
            if sent >= w1:
                break
            t0 = time.perf_counter()
            try:
                conn.request("POST", a.path, body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conn = http.client.HTTPConnection(a.host, a.port, timeout=60)
                if w0 <= sent:
                    errs[type(exc).__name__] += 1
                continue
            ms = (time.perf_counter() - t0) * 1000
            if 200 <= status < 300:
                ok += 1
            if w0 <= sent:
                mine.append(ms)
                st[str(status)] += 1
        conn.close()
        with lock:
            latencies.extend(mine)
            statuses.update(st)
            ok_total[0] += ok
            transport_errors.update(errs)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(a.threads)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, w0 - time.time()))
    cpu0 = _cpu()
    time.sleep(max(0.0, w1 - time.time()))
    cpu1 = _cpu()
    for t in threads:
        t.join(120)
    return {"latencies": latencies, "statuses": dict(statuses), "ok_total": ok_total[0],
            "transport_errors": dict(transport_errors), "cpu_s": cpu1 - cpu0}


def _pct(s: list[float], q: float) -> float | None:
    if not s:
        return None
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return 0
    start = a.start if a.start is not None else time.time() + 1.0
    base = [sys.executable, __file__, "--host", a.host, "--port", str(a.port), "--path", a.path,
            "--token", a.token, "--body-file", str(a.body_file), "--threads", str(a.threads),
            "--start", repr(start), "--warmup", repr(a.warmup), "--seconds", repr(a.seconds),
            "--child"]
    procs = [subprocess.Popen(base, stdout=subprocess.PIPE, text=True) for _ in range(a.procs)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=a.warmup + a.seconds + 300)
        if p.returncode != 0:
            print(f"client process exited {p.returncode}", file=sys.stderr)
            return 1
        outs.append(json.loads(out.strip().splitlines()[-1]))
    lat = sorted(x for o in outs for x in o["latencies"])
    statuses: Counter[str] = Counter()
    transport: Counter[str] = Counter()
    for o in outs:
        statuses.update(o["statuses"])
        transport.update(o["transport_errors"])
    non_2xx = sum(n for s, n in statuses.items() if not s.startswith("2"))
    print(json.dumps({
        "clients": a.procs * a.threads, "procs": a.procs, "threads": a.threads,
        "seconds": a.seconds, "warmup_s": a.warmup,
        "requests": len(lat), "requests_per_s": len(lat) / a.seconds,
        "latency_ms": {"n": len(lat), "p50": _pct(lat, 50), "p95": _pct(lat, 95),
                       "p99": _pct(lat, 99), "max": lat[-1] if lat else None,
                       "mean": sum(lat) / len(lat) if lat else None},
        "statuses": dict(statuses), "transport_errors": dict(transport),
        "errors": non_2xx + sum(transport.values()),
        "ok_total": sum(o["ok_total"] for o in outs),
        "client_cpu_s": sum(o["cpu_s"] for o in outs),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
