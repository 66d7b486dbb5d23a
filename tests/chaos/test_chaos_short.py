"""The short chaos run, on every CI submission: about a minute and a half of load and faults.

Real ``fenceline run`` processes against a private PostgreSQL (see ``tests.chaos.run``).
``CHAOS_SEED`` replays a run's fault order and job mix. The report is printed even when the
run passes; the long run is ``python -m tests.chaos.run --minutes 10``.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from tests.chaos.run import SHORT, run_chaos

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def test_short_chaos_run_loses_nothing_and_finishes_nothing_twice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seed = os.environ.get("CHAOS_SEED")
    config = SHORT if seed is None else replace(SHORT, seed=int(seed))
    outcome = run_chaos(config)
    with capsys.disabled():
        print("\n" + outcome.report)
        if outcome.log_dir is not None:
            print(f"process logs kept in {outcome.log_dir}")
    failed = [c for c in outcome.results if c.ok is False and not c.known_issue]
    assert not failed, "\n".join(f"{c.name}: {c.detail}" for c in failed)
