"""Exceptions that cross module boundaries.

A ``ConfigError`` is a mistake the operator must fix (bad flag, unusable data dir, wrong
PostgreSQL major version): the CLI prints its message as one line and exits non-zero, and
the supervisor never restarts a service that raised it.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class FencelineError(Exception):
    """Base class for fenceline's own errors."""


class ConfigError(FencelineError):
    """The configuration cannot work; retrying will not help."""


class DatabaseUnavailable(FencelineError):
    """PostgreSQL could not be reached (yet). Callers may retry with backoff."""


def find_exception(exc: BaseException, kind: type[E]) -> E | None:
    """The first ``kind`` in ``exc`` or, through exception groups, anywhere inside it."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = find_exception(inner, kind)
            if found is not None:
                return found
    return None
