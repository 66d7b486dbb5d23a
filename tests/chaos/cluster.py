"""What the chaos suite runs: a private PostgreSQL it may restart, and real fenceline processes.

The machine's PostgreSQL is shared, so the suite never restarts it: it runs the embedded
server (``fenceline.db.embedded.run_embedded``) in its own Trio nursery, on a data dir under
a fresh 0755 temporary folder (as root the server runs as ``nobody``). A restart is the
launcher's own shutdown (SIGINT to the postmaster: fast shutdown) followed by a start on the
same data dir and port, so the socket DSN every client holds stays valid across it.

Every fenceline process is ``python -m fenceline run`` with ``DATABASE_URL`` set and its
log (JSON lines) in a file of its own. It runs a snapshot of the code (``snapshot_code``)
taken when the run starts: the working tree is shared, and a worker restarted mid-run must
run the same code and migrations as the others, whatever is edited meanwhile.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import trio
from psycopg.conninfo import make_conninfo

from fenceline.db.embedded import EmbeddedServer, EmbeddedSettings, run_embedded

REPO_ROOT = Path(__file__).resolve().parents[2]
DATABASE = "fenceline_chaos"


def snapshot_code(dest: Path) -> Path:
    """Copy the package, its migrations and the chaos handlers under ``dest``; return it.

    The layout is the installed one (``fenceline/migrations``), so with ``dest`` as the
    working directory ``python -m fenceline`` imports the copy, not the editable checkout.
    """
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO_ROOT / "fenceline", dest / "fenceline", ignore=skip)
    shutil.copytree(REPO_ROOT / "migrations", dest / "fenceline" / "migrations", ignore=skip)
    (dest / "tests" / "chaos").mkdir(parents=True)
    (dest / "tests" / "__init__.py").touch()
    (dest / "tests" / "chaos" / "__init__.py").touch()
    shutil.copy(REPO_ROOT / "tests" / "chaos" / "handlers.py", dest / "tests" / "chaos")
    return dest


class PrivatePostgres:
    """The embedded server, started, stopped and restarted from the caller's nursery."""

    def __init__(self, base: Path) -> None:
        self.data_dir = base / "pgdata"
        self.port: int | None = None
        self.server: EmbeddedServer | None = None
        self._scope: trio.CancelScope | None = None
        self._gone: trio.Event | None = None

    @property
    def admin_dsn(self) -> str:
        assert self.server is not None
        return self.server.dsn

    @property
    def dsn(self) -> str:
        """The chaos database, over the unix socket (trust auth; stable across restarts)."""
        return make_conninfo(self.admin_dsn, dbname=DATABASE)

    async def start(self, nursery: trio.Nursery) -> None:
        settings = EmbeddedSettings(data_dir=self.data_dir, port=self.port, fsync=False,
                                    server_options={"max_connections": "200"})
        self.server = await nursery.start(self._serve, settings)
        self.port = self.server.port

    async def stop(self) -> None:
        """Fast shutdown; returns once the postmaster has exited."""
        if self._scope is None or self._gone is None:
            return
        self._scope.cancel()
        await self._gone.wait()
        self._scope = None

    async def restart(self, nursery: trio.Nursery) -> float:
        """Stop, then start on the same data dir and port; returns the seconds it was down."""
        began = trio.current_time()
        await self.stop()
        await self.start(nursery)
        return trio.current_time() - began

    async def _serve(self, settings: EmbeddedSettings, *,
                     task_status: trio.TaskStatus[EmbeddedServer] = trio.TASK_STATUS_IGNORED
                     ) -> None:
        gone = self._gone = trio.Event()
        try:
            with trio.CancelScope() as scope:
                self._scope = scope
                async with trio.open_nursery() as inner:
                    server = await inner.start(run_embedded, settings)
                    task_status.started(server)
        finally:
            gone.set()


@dataclass
class Proc:
    """One ``fenceline run`` process."""

    role: str  # "worker" or "scheduler"
    slot: int
    process: trio.Process
    log_path: Path
    log: IO[str]
    started_at: float  # wall clock (time.time())
    stopped: bool = False  # SIGSTOPped right now
    signals: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, sig: signal.Signals) -> None:
        if self.alive:
            self.signals.append(sig.name)
            self.process.send_signal(sig)
        self.stopped = sig == signal.SIGSTOP or (self.stopped and sig != signal.SIGCONT)

    async def wait(self, timeout: float) -> int | None:  # noqa: ASYNC109 - a bound, not an API
        """The exit code, or None if it is still running after ``timeout`` seconds."""
        with trio.move_on_after(timeout):
            return await self.process.wait()
        return None

    def ready(self) -> bool:
        """Whether the process has logged that it is ready (its signal handlers are set)."""
        return '"msg": "ready"' in self.log_path.read_text(errors="replace")

    async def kill_and_reap(self) -> int:
        if self.alive:
            if self.stopped:
                self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        code = await self.process.wait()
        self.log.close()
        return code


@dataclass(frozen=True)
class ProcessSettings:
    queue: str
    lease: float
    concurrency: int
    drain_timeout: float
    reaper_interval: float
    orphan_interval: float


class Fleet:
    """The worker slots and scheduler replicas; a slot whose process ended can be refilled."""

    def __init__(self, dsn: str, settings: ProcessSettings, log_dir: Path, code: Path) -> None:
        self.dsn = dsn
        self.code = code  # a snapshot_code() folder
        self.settings = settings
        self.log_dir = log_dir
        self.workers: dict[int, Proc] = {}
        self.schedulers: dict[int, Proc] = {}
        self.retired: list[tuple[Proc, int]] = []  # ended processes and their exit codes
        self.starts = 0

    def _argv(self, role: str) -> list[str]:
        s = self.settings
        if role == "worker":
            return ["--roles", "worker", "--queue", s.queue, "--lease", str(s.lease),
                    "--concurrency", str(s.concurrency), "--drain-timeout", str(s.drain_timeout),
                    "--handlers", "tests.chaos.handlers"]
        return ["--roles", "scheduler", "--reaper-interval", str(s.reaper_interval),
                "--promoter-interval", "0.5", "--breaker-interval", "1",
                "--orphan-interval", str(s.orphan_interval), "--pool-size", "4"]

    async def spawn(self, role: str, slot: int) -> Proc:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env.update(DATABASE_URL=self.dsn, LOG_FORMAT="json", PYTHONPATH=str(self.code))
        log_path = self.log_dir / f"{role}-{slot}-{self.starts}.log"
        log = log_path.open("w")
        try:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "fenceline", "run", *self._argv(role)],
                cwd=str(self.code), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log)
        except BaseException:
            log.close()
            raise
        proc = Proc(role, slot, process, log_path, log, time.time())
        (self.workers if role == "worker" else self.schedulers)[slot] = proc
        return proc

    async def retire(self, proc: Proc) -> int:
        """Reap a process that has ended (or kill it), keeping its exit code."""
        code = await proc.kill_and_reap()
        self.retired.append((proc, code))
        return code

    def all(self) -> list[Proc]:
        return [*self.workers.values(), *self.schedulers.values()]

    async def stop_all(self, timeout: float) -> list[tuple[Proc, int | None]]:  # noqa: ASYNC109
        """SIGTERM everything still running (SIGCONT first where stopped); wait; kill what is
        left. Returns the exit codes of the processes that were running.

        A process still starting up is given time to get ready first: before Trio installs
        its handler, SIGTERM would simply kill it."""
        procs = [p for p in self.all() if p.alive]
        with trio.move_on_after(timeout):
            while True:
                if all(p.ready() or not p.alive for p in procs):
                    break
                await trio.sleep(0.1)
        for p in procs:
            if p.stopped:
                p.send(signal.SIGCONT)
            p.send(signal.SIGTERM)
        codes: list[tuple[Proc, int | None]] = []
        deadline = trio.current_time() + timeout
        for p in procs:
            code = await p.wait(max(0.0, deadline - trio.current_time()))
            codes.append((p, code))
        for p in self.all():
            self.retired.append((p, await p.kill_and_reap()))
        self.workers.clear()
        self.schedulers.clear()
        return codes

    async def kill_all(self) -> None:
        """Last-resort clean-up: nothing of ours outlives the run."""
        with trio.CancelScope(shield=True):
            for p in self.all():
                self.retired.append((p, await p.kill_and_reap()))
            self.workers.clear()
            self.schedulers.clear()
