"""fenceline adapter: runs in the project's own venv (the harness's interpreter).

Not written yet: the engine is in progress. Every command exits with code 3, which the
harness reports as "not available". To fill it in, keep this command line (see
bench/adapters/_common.py for the protocol and bench/adapters/pgqueuer_worker.py for a
complete example):

- info: versions, the settings used and their source, and remaining_sql, for example
  "exists(select 1 from fl.jobs where status in ('queued', 'running'))".
- setup: run fenceline's migrations in --dsn.
- enqueue N: bulk-insert N no-op jobs (COPY or one `select fl.submit(...)` per batch).
- work --concurrency 16 --records PATH: a `fenceline.Worker` with 16 slots; print
  `ready <unix time>` when it starts consuming; the handler appends
  (job id, submit ts from the payload, time.time()) to a list and does nothing else;
  SIGTERM stops it gracefully, then write the list to PATH and print `result`.
- produce --rate R --seconds S: `select fl.submit(...)` one job at a time via
  _common.paced, the payload carrying the submit timestamp.
"""

from __future__ import annotations

import _common

PEER = "fenceline"


def main(argv: list[str] | None = None) -> None:
    _common.parse_args(PEER, argv)
    _common.not_available("fenceline adapter not implemented yet")


if __name__ == "__main__":
    main()
