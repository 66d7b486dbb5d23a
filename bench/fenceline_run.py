"""`fenceline run` with the benchmark's pinned migrations.

The recovery workload starts real `fenceline run --roles=worker|scheduler` processes. Those
apply migrations on start, from migrations/ of this working tree, which other people edit
while the benchmark runs (a half-written migration makes start-up refuse, and an edited one
no longer matches what the bench database was migrated with). When the harness has pinned
the schema (BENCH_FENCELINE_MIGRATIONS, a directory holding HEAD's migrations/), this
wrapper makes the migrator read that directory instead; everything else is the real
`fenceline run` (the same supervisor, services and settings).

    python bench/fenceline_run.py --roles=worker --queue Q --concurrency 4 --lease 5 ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fenceline import cli
from fenceline.db import migrator

PINNED = os.environ.get("BENCH_FENCELINE_MIGRATIONS")


def main() -> int:
    if PINNED:
        loader = migrator.load_migrations

        def pinned(source: object = None) -> tuple[migrator.Migration, ...]:
            return loader(Path(PINNED))  # type: ignore[arg-type]

        migrator.load_migrations = pinned  # type: ignore[assignment]
    return cli.main(["run", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
