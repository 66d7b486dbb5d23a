"""Every advisory lock key fenceline takes, in one place.

Keys use the two-integer form ``pg_advisory_lock(NAMESPACE, key)`` so they cannot collide
with an application's own single-bigint advisory locks in the same database. Per-entity
locks (a queue's cap, say) are taken in SQL with the namespace of their own kind, listed here
too so that a reader sees every lock the system can hold.
"""

from __future__ import annotations

import enum

# 'fl' in ASCII: the classid of every single-runner fenceline advisory lock.
NAMESPACE = 0x666C
# 'fm': the classid of per-queue locks, objid = hashtext(queue id). fl.claim holds one for
# the rest of its transaction so the concurrency cap is counted and filled atomically.
QUEUE_NAMESPACE = 0x666D


class Lock(enum.IntEnum):
    """Process-wide single-runner locks (objid under NAMESPACE)."""

    MIGRATE = 1
    REAPER = 10
    PROMOTER = 11
    CRON = 12
    BREAKER = 13
    RECONCILE = 14
    NOTIFIER = 15
    ARCHIVER = 16
    ROLLUP = 17
    PARTITIONS = 18
    SUMMARIES = 19
    LEASE_ORPHANS = 20
    WORKER_LIVENESS = 21
    EVENTS_RETENTION = 22
