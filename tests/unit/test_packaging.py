"""The wheel ships every package and the migrations."""

from __future__ import annotations

import tomllib
from pathlib import Path

from fenceline.db import migrator

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "fenceline").rglob("__init__.py")
    } | {"fenceline.migrations"}
    assert on_disk == listed


def test_migrations_load_from_the_package() -> None:
    found = migrator.load_migrations()
    files = sorted(p.name for p in (ROOT / "migrations").glob("*.sql"))
    assert [m.filename for m in found] == files
    assert found[0].version == 1
