"""Every advisory lock the SQL takes is listed in fenceline/db/locks.py."""

from __future__ import annotations

import re
from pathlib import Path

from fenceline.db.locks import NAMESPACE, QUEUE_NAMESPACE, Lock

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"
_CALL = re.compile(r"pg_(?:try_)?advisory_(?:xact_)?lock\(\s*(\d+)\s*,\s*([^)]+?)\s*\)")


def test_sql_lock_keys_are_all_declared() -> None:
    found = [m.groups() for f in sorted(MIGRATIONS.glob("*.sql"))
             for m in _CALL.finditer(f.read_text())]
    assert found, "the engine takes advisory locks; the pattern must find them"
    declared = {int(k) for k in Lock}
    for classid, objid in found:
        if int(classid) == NAMESPACE:
            assert int(objid) in declared, f"lock ({classid}, {objid}) is not in locks.Lock"
        else:
            assert int(classid) == QUEUE_NAMESPACE, f"unknown lock namespace {classid}"
