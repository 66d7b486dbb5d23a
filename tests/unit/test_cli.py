"""The command line: bad input is one line on stderr and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def fenceline(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "fenceline", *args], capture_output=True,
                          text=True, env=full_env, timeout=60)


def test_version() -> None:
    out = fenceline("version")
    assert out.returncode == 0
    assert out.stdout.startswith("fenceline ")


def test_run_help_documents_every_setting() -> None:
    from fenceline import config

    out = fenceline("run", "--help")
    assert out.returncode == 0
    for s in config.SETTINGS:
        if "run" in s.commands:
            assert s.flag in out.stdout
            assert s.env in out.stdout


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (["run", "--roles", "api,bogus"], {}, "unknown role bogus"),
        (["run"], {"DATABASE_URL": "definitely not a dsn"}, "DATABASE_URL"),
        (["run", "--api-port", "99999"], {}, "between 1 and 65535"),
        (["migrate"], {"DATABASE_URL": "mysql://nope"}, "must start with postgresql://"),
        (["frobnicate"], {}, "invalid choice"),
        (["run", "--no-such-flag"], {}, "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], env: dict[str, str],
                                          fragment: str) -> None:
    out = fenceline(*args, env=env)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert fragment in lines[0]


def test_run_refuses_a_port_in_use() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        out = fenceline("run", "--api-port", str(port),
                        env={"DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none"})
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "already in use" in lines[0]


def test_migrate_fails_fast_when_database_unreachable() -> None:
    out = fenceline("migrate", env={"DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none"})
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "cannot reach the database" in lines[0]
