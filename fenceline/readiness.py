"""What the process can say about its own readiness, shared by the supervisor and the API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fenceline.db.pool import Pool


@dataclass
class Readiness:
    """Set by the supervisor as start-up proceeds; read by ``/readyz``.

    ``pool`` is None until the database has been reached and migrated; until then
    ``reason`` says what the process is waiting for, in words an operator can act on.
    """

    pool: Pool | None = None
    reason: str | None = "starting"
    embedded_dsn: str | None = None
