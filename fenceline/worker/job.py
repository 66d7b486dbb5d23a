"""What a handler sees: ``Job``, and the exceptions it raises to say how the attempt ended."""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass, field
from typing import Any

from fenceline.errors import FencelineError

LOG_LEVELS = ("debug", "info", "warn", "error")
# Lines kept per attempt before the oldest are dropped (and the drop is itself logged).
MAX_LOG_LINES = 1000


class Snooze(FencelineError):
    """Put the job back for ``seconds`` without using an attempt."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"snooze {seconds}s")
        self.seconds = seconds


class PermanentError(FencelineError):
    """The job can never succeed: dead-letter it now instead of retrying."""


@dataclass
class Job:
    """One attempt of one job, handed to a handler.

    ``fence`` names this attempt: pass it to downstream systems as an idempotency token.
    A report made with a stale fence is refused by the database, so a handler that outlived
    its lease cannot complete the job that moved on without it.
    """

    id: int
    type: str
    payload: Any
    fence: int
    attempt: int
    queue_id: Any
    deadline_at: dt.datetime
    _progress: Any = field(default=None, repr=False)
    _progress_dirty: bool = field(default=False, repr=False)
    _logs: list[tuple[str, str, dt.datetime]] = field(default_factory=list, repr=False)
    _dropped_logs: int = field(default=0, repr=False)
    # Made on first use: most handlers never look, and a threading.Event (a Condition and
    # two locks) per job was about 3 % of a busy worker's CPU. The runtime makes it before a
    # sync handler's thread starts, so both threads always see the same one.
    _cancelled: threading.Event | None = field(default=None, repr=False)
    _cancel_set: bool = field(default=False, repr=False)

    @property
    def cancelled(self) -> threading.Event:
        """Set when the attempt is cancelled (lease lost, drain timeout).

        Sync handlers run in a thread and cannot be interrupted: they should check it and
        return early.
        """
        if self._cancelled is None:
            self._cancelled = threading.Event()
            if self._cancel_set:
                self._cancelled.set()
        return self._cancelled

    def _mark_cancelled(self) -> None:
        self._cancel_set = True
        if self._cancelled is not None:
            self._cancelled.set()

    async def progress(self, value: Any) -> None:
        """Record progress; it rides on the next heartbeat (no extra round trip)."""
        self._progress = value
        self._progress_dirty = True

    def log(self, message: str, level: str = "info") -> None:
        """Append a log line to this attempt's ledger (flushed with heartbeats and reports)."""
        if level not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}")
        if len(self._logs) >= MAX_LOG_LINES:
            self._logs.pop(0)
            self._dropped_logs += 1
        self._logs.append((level, str(message)[:16384], dt.datetime.now(dt.UTC)))

    def take_logs(self) -> list[tuple[str, str, dt.datetime]]:
        lines = self._logs
        self._logs = []
        if self._dropped_logs:
            lines.insert(0, ("warn", f"{self._dropped_logs} log lines dropped "
                                     f"(more than {MAX_LOG_LINES} between flushes)",
                             dt.datetime.now(dt.UTC)))
            self._dropped_logs = 0
        return lines
