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


def test_every_third_party_import_is_a_declared_dependency() -> None:
    """A module imported by the package but only installed by the test extras would break
    `pip install .` users (it happened: httpx came in through the test extras only)."""
    import ast
    import sys

    special = {"argon2-cffi": "argon2", "psycopg[binary]": "psycopg"}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = set()
    for dep in deps:
        name = dep.split(";")[0].strip()
        for cut in "<>=!~ ":
            name = name.split(cut)[0]
        declared.add(special.get(name, name.split("[")[0]).replace("-", "_").lower())
    imported = set()
    for path in (ROOT / "fenceline").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"fenceline"}
    assert third_party - declared == set()
