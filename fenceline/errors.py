"""Exceptions that cross module boundaries.

A ``ConfigError`` is a mistake the operator must fix (bad flag, unusable data dir, wrong
PostgreSQL major version): the CLI prints its message as one line and exits non-zero, and
the supervisor never restarts a service that raised it.
"""

from __future__ import annotations


class FencelineError(Exception):
    """Base class for fenceline's own errors."""


class ConfigError(FencelineError):
    """The configuration cannot work; retrying will not help."""


class DatabaseUnavailable(FencelineError):
    """PostgreSQL could not be reached (yet). Callers may retry with backoff."""
