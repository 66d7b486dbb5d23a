"""Harness plumbing: PostgreSQL access, machine facts, CPU/WAL/commit windows, statistics,
JSON results and printed tables. Nothing here knows about a particular peer or workload.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil
import psycopg
from psycopg import conninfo, sql

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
KEY_SETTINGS = (
    "server_version",
    "shared_buffers",
    "synchronous_commit",
    "fsync",
    "full_page_writes",
    "wal_sync_method",
    "wal_level",
    "max_connections",
    "max_wal_size",
    "checkpoint_timeout",
    "work_mem",
    "autovacuum",
    "jit",
)
# Server processes that work for every database (WAL, checkpoints): counted in "PG CPU".
AUX_BACKEND_TYPES = ("checkpointer", "background writer", "walwriter")


def log(msg: str) -> None:
    print(msg, flush=True)


def utc_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def url_for(dsn: str, dbname: str) -> str:
    """A postgresql:// URL for dsn with its database replaced (asyncpg only takes URLs)."""
    params = conninfo.conninfo_to_dict(dsn)
    user = quote(str(params.pop("user", "postgres")), safe="")
    password = params.pop("password", None)
    host = str(params.pop("host", "127.0.0.1"))
    port = str(params.pop("port", "5432"))
    params.pop("dbname", None)
    auth = user + (":" + quote(str(password), safe="") if password else "")
    query = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in params.items())
    return f"postgresql://{auth}@{host}:{port}/{dbname}" + (f"?{query}" if query else "")


class Postgres:
    """The harness's own connection, to the maintenance database (never a peer's)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.own_pid: int = self.scalar("select pg_backend_pid()")
        self.local = _is_local_server(self.own_pid)

    def close(self) -> None:
        self.conn.close()

    def scalar(self, query: str, params: Sequence[Any] | None = None) -> Any:
        row = self.conn.execute(query, params).fetchone()  # type: ignore[arg-type]
        return row[0] if row else None

    def rows(self, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        return self.conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def settings(self) -> dict[str, str]:
        out = {name: str(self.scalar(f"show {name}")) for name in KEY_SETTINGS}
        out["version"] = str(self.scalar("select version()"))
        return out

    def drop_database(self, name: str) -> None:
        self.conn.execute(
            sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
        )

    def fresh_database(self, name: str) -> None:
        self.drop_database(name)
        self.conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))

    def checkpoint(self) -> None:
        self.conn.execute("checkpoint")

    def analyze_and_checkpoint(self, dbname: str, checkpoint: bool = True) -> None:
        with psycopg.connect(url_for(self.dsn, dbname), autocommit=True) as conn:
            conn.execute("analyze")
        if checkpoint:
            self.conn.execute("checkpoint")

    def wal_lsn(self) -> int:
        return int(self.scalar("select pg_current_wal_lsn() - '0/0'::pg_lsn"))

    def activity(self, dbname: str) -> list[dict[str, Any]]:
        """What each backend of dbname is doing (kept when a drain times out)."""
        cols = ("pid", "state", "wait_event_type", "wait_event", "xact_s", "query_s", "query")
        rows = self.rows(
            "select pid, state, wait_event_type, wait_event,"
            " extract(epoch from now() - xact_start)::float,"
            " extract(epoch from now() - query_start)::float, left(query, 200)"
            " from pg_stat_activity where datname = %s",
            (dbname,),
        )
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def checkpoints(self) -> int:
        return int(self.scalar("select checkpoints_timed + checkpoints_req from pg_stat_bgwriter"))

    def transactions(self, dbname: str) -> int:
        return int(
            self.scalar(
                "select xact_commit + xact_rollback from pg_stat_database where datname = %s",
                (dbname,),
            )
        )

    def backend_pids(self, dbname: str) -> set[int]:
        return {
            r[0]
            for r in self.rows("select pid from pg_stat_activity where datname = %s", (dbname,))
        }

    def aux_pids(self) -> set[int]:
        return {
            r[0]
            for r in self.rows(
                "select pid from pg_stat_activity where backend_type = any(%s)",
                (list(AUX_BACKEND_TYPES),),
            )
        }

    def wait_database_idle(self, dbname: str, timeout: float = 30.0) -> None:
        """Wait until no backend is connected to dbname, so its statistics are flushed."""
        deadline = time.monotonic() + timeout
        while self.backend_pids(dbname):
            if time.monotonic() > deadline:
                raise RuntimeError(f"backends still connected to {dbname} after {timeout:.0f} s")
            time.sleep(0.05)
        # An exiting backend reports its counters on the way out; give that a moment.
        time.sleep(0.2)

    def database_oid(self, dbname: str) -> int:
        return int(self.scalar("select oid from pg_database where datname = %s", (dbname,)))

    def hold_wal(self) -> str | None:
        """Keep the WAL from now on until release_wal, so pg_waldump can read a long window.

        A temporary physical replication slot: it belongs to this session, so PostgreSQL drops
        it by itself if the harness dies. No server setting changes. Other people's writes
        recycle WAL segments within minutes on this shared server; without the slot the start
        of a long window would be gone by the time it is read.
        """
        name = f"fenceline_bench_{os.getpid()}"
        try:
            self.conn.execute("select pg_create_physical_replication_slot(%s, true, true)", (name,))
        except psycopg.Error:
            return None
        return name

    def release_wal(self, slot: str | None) -> None:
        if slot:
            with contextlib.suppress(psycopg.Error):
                self.conn.execute("select pg_drop_replication_slot(%s)", (slot,))

    def wal_tools(self) -> tuple[Path, Path] | None:
        """(pg_waldump, pg_wal directory) when the server is local and they can be read."""
        if not self.local:
            return None
        try:
            postmaster = psutil.Process(psutil.Process(self.own_pid).ppid())
            waldump = Path(postmaster.exe()).parent / "pg_waldump"
            pg_wal = Path(str(self.scalar("show data_directory"))) / "pg_wal"
        except (psutil.Error, OSError, psycopg.Error):
            return None
        if waldump.exists() and os.access(pg_wal, os.R_OK | os.X_OK):
            return waldump, pg_wal
        return None


class CommitProbe:
    """Times one-row INSERT + COMMIT round trips in a scratch database of the harness's own.

    On this machine that is mostly the WAL flush (fdatasync), shared with everyone using the
    server: the figure that explains absolute throughput, read at start, end and before each
    run.
    """

    def __init__(self, pg: Postgres, dbname: str) -> None:
        self.pg = pg
        self.dbname = dbname
        pg.fresh_database(dbname)
        with psycopg.connect(url_for(pg.dsn, dbname), autocommit=True) as conn:
            conn.execute("create table t (x int)")

    def median_ms(self, n: int) -> float:
        with psycopg.connect(url_for(self.pg.dsn, self.dbname), autocommit=True) as conn:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                conn.execute("insert into t values (1)")
                times.append((time.perf_counter() - t0) * 1000)
        return round(statistics.median(times), 3)

    def drop(self) -> None:
        self.pg.drop_database(self.dbname)


@dataclass
class ScratchDatabase:
    """A fresh database for a profiling aid, with fenceline's migrations pinned (below)."""

    pg: Postgres
    name: str
    url: str
    commit: str | None
    work: Path  # a new temporary folder for the aid's files


def scratch_database(dsn: str, name: str) -> ScratchDatabase:
    """Pin the migrations into a new temporary folder and create database ``name`` afresh."""
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    commit = pin_fenceline_migrations(work)
    pg = Postgres(dsn)
    pg.fresh_database(name)
    return ScratchDatabase(pg, name, url_for(dsn, name), commit, work)


def pin_fenceline_migrations(workdir: Path) -> str | None:
    """Copy migrations/ as committed at HEAD into workdir and point fenceline's adapter (and
    bench/fenceline_run.py) at the copy, through the environment its processes inherit.

    Other people edit migrations/ in this working tree while benchmarks run; a half-written
    file would make every fenceline run fail, and an edited one would make the schema differ
    between runs. Returns the commit, or None (no git checkout: the working tree is used).
    """
    repo = BENCH_DIR.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", commit, "migrations"],
            capture_output=True, timeout=60, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    import io
    import tarfile

    target = workdir / "pinned"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    os.environ["BENCH_FENCELINE_MIGRATIONS"] = str(target / "migrations")
    os.environ["BENCH_FENCELINE_MIGRATIONS_COMMIT"] = commit
    return commit


def _lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


_WAL_RECORD = re.compile(r"len \(rec/tot\):\s*(\d+)/\s*(\d+), tx:\s*(\d+),")


def wal_of_database(tools: tuple[Path, Path], start: int, end: int, dboid: int) -> dict[str, Any]:
    """WAL written for one database between two LSNs, from pg_waldump.

    A record counts when one of its blocks belongs to the database (rel <spc>/<dboid>/<rel>),
    and so do the commit/abort records of the transactions that wrote those records. Other
    databases' records (other people's tests on this server) and server-wide records
    (checkpoints, running-xacts) are left out. Bytes are record lengths, full-page images
    included (and also given apart: every checkpoint, whoever causes it, makes the next
    change to each page log a whole 8 kB image).
    """
    waldump, pg_wal = tools
    cmd = [str(waldump), "-p", str(pg_wal), "-s", _lsn(start), "-e", _lsn(end)]
    marker = f"/{dboid}/"
    ours = records = images = 0
    xids: set[int] = set()
    xact_bytes: dict[int, int] = {}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None and p.stderr is not None
        for line in p.stdout:
            if marker in line:
                m = _WAL_RECORD.search(line)
                if m:
                    ours += int(m.group(2))
                    images += int(m.group(2)) - int(m.group(1))
                    records += 1
                    if m.group(3) != "0":
                        xids.add(int(m.group(3)))
            elif line.startswith("rmgr: Transaction"):
                m = _WAL_RECORD.search(line)
                if m:
                    tx = int(m.group(3))
                    xact_bytes[tx] = xact_bytes.get(tx, 0) + int(m.group(2))
        err = p.stderr.read()
    if p.returncode != 0:
        return {"bytes": None, "error": err.strip()[-300:]}
    ours += sum(n for tx, n in xact_bytes.items() if tx in xids)
    return {
        "bytes": ours,
        "full_page_image_bytes": images,
        "records": records,
        "transactions": len(xids),
    }


def _is_local_server(pid: int) -> bool:
    """Whether the server's backends are processes on this host (so psutil can read them)."""
    try:
        return "postgres" in psutil.Process(pid).name()
    except (psutil.Error, OSError):
        return False


class Probe:
    """Polls the peer's own "anything queued or running?" SQL on one connection.

    Its queries are counted so that they can be taken out of the commit count.
    """

    def __init__(self, url: str, remaining_sql: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.pid: int = self.conn.execute("select pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        self.query = f"select {remaining_sql}"
        # Backend start-up runs one counted transaction, then the pid query (measured).
        self.queries = 2

    def remaining(self) -> bool:
        self.queries += 1
        row = self.conn.execute(self.query).fetchone()  # type: ignore[arg-type]
        return bool(row and row[0])

    def wait_empty(self, timeout: float, interval: float = 0.005) -> tuple[bool, float]:
        """Poll until nothing is queued or running; return (drained, monotonic time seen)."""
        deadline = time.monotonic() + timeout
        while True:
            busy = self.remaining()
            now = time.monotonic()
            if not busy:
                return True, now
            if now > deadline:
                return False, now
            time.sleep(interval)

    def close(self) -> None:
        self.conn.close()


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _busy_seconds() -> float:
    t = psutil.cpu_times()
    return float(
        sum(
            getattr(t, f)
            for f in ("user", "nice", "system", "irq", "softirq", "steal")
            if hasattr(t, f)
        )
    )


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except psutil.Error:
        return None


@dataclass
class Sample:
    t: float
    wal: int
    worker_cpu: float
    pg_db: dict[int, float]
    pg_all: dict[int, float]
    busy: float


@dataclass
class Sampler:
    """CPU, WAL and host-load readings at the two ends of a measured window.

    PG CPU ("pg_cpu_s") is the CPU of the backends connected to the peer's database (the
    probe's excepted) plus the checkpointer, background writer and WAL writer; other
    databases' backends (other people's tests on this shared server) are left out.
    "pg_cpu_all_s" is every server process, as the prototype measured it. Both are read
    while the worker is still connected: a backend that exits inside the window drops out
    of a psutil sum (the prototype's trap); such exits are counted in exited_backends.
    """

    pg: Postgres
    dbname: str
    exclude: set[int] = field(default_factory=set)

    def sample(self, worker_pid: int) -> Sample:
        try:
            worker = psutil.Process(worker_pid)
            worker_cpu = _cpu_seconds(worker) + sum(
                _cpu_seconds(c) for c in worker.children(recursive=True)
            )
        except psutil.Error:
            worker_cpu = math.nan
        t = time.monotonic()
        wal = self.pg.wal_lsn()
        pg_db: dict[int, float] = {}
        pg_all: dict[int, float] = {}
        if self.pg.local:
            wanted = (self.pg.backend_pids(self.dbname) | self.pg.aux_pids()) - self.exclude
            for pid in wanted:
                with contextlib.suppress(psutil.Error):
                    pg_db[pid] = _cpu_seconds(psutil.Process(pid))
            with contextlib.suppress(psutil.Error):
                postmaster = psutil.Process(psutil.Process(self.pg.own_pid).ppid())
                for proc in [postmaster, *postmaster.children()]:
                    with contextlib.suppress(psutil.Error):
                        pg_all[proc.pid] = _cpu_seconds(proc)
        return Sample(t, wal, worker_cpu, pg_db, pg_all, _busy_seconds())

    @staticmethod
    def window(s0: Sample, s1: Sample) -> dict[str, Any]:
        def delta(a: dict[int, float], b: dict[int, float]) -> tuple[float, int]:
            total = sum(v - a.get(pid, 0.0) for pid, v in b.items())
            return total, len(set(a) - set(b))

        pg_db, exited = delta(s0.pg_db, s1.pg_db)
        pg_all, _ = delta(s0.pg_all, s1.pg_all)
        seconds = s1.t - s0.t
        worker = s1.worker_cpu - s0.worker_cpu
        have_pg = bool(s1.pg_db)
        other = (s1.busy - s0.busy) - worker - pg_all if have_pg else math.nan
        return {
            "window_s": seconds,
            "worker_cpu_s": worker,
            "pg_cpu_s": pg_db if have_pg else None,
            "pg_cpu_all_s": pg_all if have_pg else None,
            "wal_bytes": s1.wal - s0.wal,
            "exited_backends": exited,
            "other_load_cores": round(other / seconds, 3) if seconds > 0 and have_pg else None,
        }


def host_busy_cores(interval: float = 0.25) -> float:
    return psutil.cpu_percent(interval=interval) / 100 * (psutil.cpu_count() or 1)


def wait_quiet(max_wait: float, threshold_cores: float = 0.3) -> float:
    """Wait (at most max_wait s) for the host to drop below threshold busy cores.

    Returns the last reading; the run goes ahead either way and the reading is recorded.
    """
    deadline = time.monotonic() + max_wait
    busy = host_busy_cores()
    while busy > threshold_cores and time.monotonic() < deadline:
        busy = host_busy_cores()
    return round(busy, 3)


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(pg: Postgres) -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {
        "hostname": platform.node(),
        "os": platform.platform(),
        "cpu_model": cpu_model(),
        "cores_logical": psutil.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "memory_gib": round(vm.total / 2**30, 1),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "postgres": pg.settings(),
        "postgres_local": pg.local,
        "harness_python": sys.version.split()[0],
        "harness_packages": {n: _dist_version(n) for n in ("psycopg", "psutil", "fenceline")},
    }


# ----------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(values: Iterable[float | None]) -> dict[str, float | int]:
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return {"n": 0}
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "p50": percentile(vals, 50),
        "p95": percentile(vals, 95),
        "p99": percentile(vals, 99),
    }


def latency_stats(ms: Sequence[float]) -> dict[str, float | int]:
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50": percentile(ms, 50),
        "p95": percentile(ms, 95),
        "p99": percentile(ms, 99),
        "min": min(ms),
        "max": max(ms),
        "mean": statistics.fmean(ms),
    }


# ----------------------------------------------------------------------------- output


def fmt(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float | int):
        return f"{value:,.{digits}f}"
    return str(value)


def fmt_spread(s: dict[str, Any], digits: int = 0) -> str:
    if not s or not s.get("n"):
        return "-"
    if s["n"] == 1:
        return fmt(s["median"], digits)
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    """A Markdown table (pipe format), padded so it also reads well in a terminal."""
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(out) + " |"

    sep = ["-" * (w - 1) + (":" if i in right else "-") for i, w in enumerate(widths)]
    return "\n".join([line(headers), "| " + " | ".join(sep) + " |", *(line(r) for r in rows)])


def write_results(results_dir: Path, stamp: str, workload: str, payload: dict[str, Any]) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{stamp}-{workload}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path
