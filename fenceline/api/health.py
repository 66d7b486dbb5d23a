"""``/healthz`` (the process answers) and ``/readyz`` (it can do its job).

Readiness asks PostgreSQL on every call, with a short bound: a load balancer should stop
sending traffic the moment the database is gone, not a poll interval later.
"""

from __future__ import annotations

import trio
from quart import Blueprint, current_app

from fenceline.api.problems import Problem
from fenceline.db import migrator
from fenceline.readiness import Readiness

blueprint = Blueprint("health", __name__)

READY_CHECK_TIMEOUT = 2.0


@blueprint.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@blueprint.get("/readyz")
async def readyz() -> dict[str, object]:
    readiness: Readiness = current_app.config["FENCELINE_READINESS"]
    pool = readiness.pool
    if pool is None:
        raise Problem(503, "not_ready", "Not ready", readiness.reason or "starting")
    try:
        with trio.fail_after(READY_CHECK_TIMEOUT):
            async with pool.connection() as conn:
                state = await migrator.status(conn)
    except trio.TooSlowError:
        raise Problem(503, "not_ready", "Not ready",
                      f"database did not answer within {READY_CHECK_TIMEOUT:g}s") from None
    except Exception as exc:  # any database failure means "not ready", said plainly
        raise Problem(503, "not_ready", "Not ready",
                      f"database unreachable: {str(exc).strip() or type(exc).__name__}") from None
    if not state.current:
        names = ", ".join(m.filename for m in state.pending)
        raise Problem(503, "not_ready", "Not ready", f"migrations pending: {names}")
    return {"status": "ready", "schema_version": max(state.applied, default=0)}
