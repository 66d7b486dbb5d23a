"""Settings: precedence, validation, and that every setting is documented."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fenceline import config
from fenceline.errors import ConfigError

README = Path(__file__).resolve().parents[2] / "README.md"


def parse(argv: list[str], command: str = "run") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, command)
    return parser.parse_args(argv)


def test_defaults_when_nothing_is_set() -> None:
    s = config.load("run", parse([]), environ={})
    assert s.database_url is None
    assert s.embedded
    assert s.roles == frozenset({"api", "scheduler", "worker", "archiver"})
    assert (s.api_addr, s.api_port) == ("127.0.0.1", 3001)
    assert s.lease == 30.0
    assert s.concurrency == 16


def test_flag_beats_environment_beats_default() -> None:
    env = {"API_PORT": "4000", "FENCELINE_ROLES": "worker"}
    s = config.load("run", parse(["--api-port", "5000"]), environ=env)
    assert s.api_port == 5000
    assert s.roles == frozenset({"worker"})


def test_empty_environment_value_means_unset() -> None:
    s = config.load("run", parse([]), environ={"DATABASE_URL": ""})
    assert s.database_url is None


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--roles", "api,banana"], {}, "unknown role banana"),
        (["--roles", ","], {}, "at least one role"),
        ([], {"DATABASE_URL": "mysql://x"}, "must start with postgresql://"),
        ([], {"DATABASE_URL": "host=localhost port=5432 nonsense"}, "not a valid PostgreSQL"),
        ([], {"DATABASE_URL": "postgresql://u@h:notaport/db"}, "not a valid PostgreSQL"),
        (["--api-port", "0"], {}, "between 1 and 65535"),
        (["--api-port", "http"], {}, "not a number"),
        ([], {"API_PORT": "70000"}, "between 1 and 65535"),
        (["--concurrency", "0"], {}, "at least 1"),
        (["--lease", "-5"], {}, "positive number of seconds"),
        (["--lease", "nan"], {}, "positive number of seconds"),
        (["--log-level", "loud"], {}, "must be one of debug, info"),
        (["--password-profile", "fast"], {}, "must be one of standard, minimal"),
        ([], {"FENCELINE_API_PREPARE": "maybe"}, "must be one of on, off"),
        (["--events-retention-days", "0"], {}, "above 0 and at most 36500"),
        ([], {"FENCELINE_EVENTS_RETENTION_DAYS": "nan"}, "above 0 and at most 36500"),
        (["--events-retention-days", "1e9"], {}, "above 0 and at most 36500"),
        ([], {"API_ALLOWED_ORIGINS": "https://ok.example, example.com"},
         "must look like https://example.com"),
    ],
)
def test_bad_values_name_the_source_and_the_problem(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config.load("run", parse(argv), environ=env)
    text = str(info.value)
    assert message in text
    assert "\n" not in text
    source = argv[0] if argv else next(iter(env))
    assert text.startswith(source)


def test_every_setting_is_documented_in_the_readme() -> None:
    readme = README.read_text()
    missing = [s.env for s in config.SETTINGS if f"`{s.env}`" not in readme]
    assert missing == []


def test_settings_dataclass_covers_every_setting() -> None:
    fields = set(config.Settings.__dataclass_fields__)
    assert {s.name for s in config.SETTINGS} == fields


def test_handlers_module_must_load_and_define_handlers() -> None:
    from fenceline.worker.service import load_handlers

    assert load_handlers(None) == {}
    with pytest.raises(ConfigError, match="cannot import"):
        load_handlers("no_such_module_anywhere")
    with pytest.raises(ConfigError, match="must define HANDLERS"):
        load_handlers("json")
    with pytest.raises(ConfigError, match="dotted Python module name"):
        config.load("run", parse(["--handlers", "not a module"]), environ={})


def test_allowed_origins_are_split_and_trimmed() -> None:
    settings = config.load("run", parse([]), environ={
        "API_ALLOWED_ORIGINS": " https://a.example/ , http://*.b.example:8080 "})
    assert settings.api_allowed_origins == ("https://a.example", "http://*.b.example:8080")
    assert config.load("run", parse([]), environ={}).api_allowed_origins == ()

