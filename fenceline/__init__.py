"""fenceline: a PostgreSQL-backed job scheduler on Trio.

    import fenceline

    worker = fenceline.Worker(queue="acme/billing/emails", concurrency=16)

    @worker.handler("send_email")
    async def send_email(job: fenceline.Job) -> dict | None:
        ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Job", "PermanentError", "Snooze", "Worker", "__version__"]

if TYPE_CHECKING:
    from fenceline.worker.job import Job, PermanentError, Snooze
    from fenceline.worker.runtime import Worker

_EXPORTS = {
    "Job": "fenceline.worker.job",
    "PermanentError": "fenceline.worker.job",
    "Snooze": "fenceline.worker.job",
    "Worker": "fenceline.worker.runtime",
}


def __getattr__(name: str) -> Any:
    # Lazy, so `fenceline --help` does not import the whole runtime.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fenceline' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
