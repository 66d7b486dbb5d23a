"""The keyset cursor helper: round trips, and every malformed cursor is a 400."""

from __future__ import annotations

import base64
import datetime as dt
import json
import uuid

import pytest

from fenceline.api.pagination import (
    DEFAULT_LIMIT,
    decode_cursor,
    encode_cursor,
    make_page,
    page_limit,
    page_query,
)
from fenceline.api.problems import Problem
from fenceline.api.validation import check

KINDS = ("timestamp", "uuid", "int", "str")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def test_round_trip_keeps_every_kind() -> None:
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    ident = uuid.uuid4()
    values = [when, ident, -(2**63), "näme/with=odd chars"]
    cursor = encode_cursor(values)
    assert "=" not in cursor and "+" not in cursor and "/" not in cursor
    back = decode_cursor({"cursor": cursor}, KINDS)
    assert back == values
    assert back is not None and back[0].utcoffset() == dt.timedelta(0)   # normalised to UTC


def test_no_cursor_is_none() -> None:
    assert decode_cursor({}, ("int",)) is None


@pytest.mark.parametrize("cursor", [
    "!!!",                                        # not base64
    _b64(b"\xff\xfe"),                            # not UTF-8
    _b64(b"{nope"),                               # not JSON
    _b64(b'{"a": 1}'),                            # not an array
    _b64(b"[1]"),                                 # too short
    _b64(b'["2026-01-01T00:00:00+00:00", "x", 1, "s"]'),   # not a uuid
    _b64(json.dumps(["2026-01-01T00:00:00", str(uuid.uuid4()), 1, "s"]).encode()),  # no tz
    _b64(json.dumps(["yesterday", str(uuid.uuid4()), 1, "s"]).encode()),
    _b64(json.dumps(["2026-01-01T00:00:00Z", str(uuid.uuid4()), True, "s"]).encode()),
    _b64(json.dumps(["2026-01-01T00:00:00Z", str(uuid.uuid4()), 2**63, "s"]).encode()),
    _b64(json.dumps(["2026-01-01T00:00:00Z", str(uuid.uuid4()), 1.5, "s"]).encode()),
    _b64(json.dumps(["2026-01-01T00:00:00Z", str(uuid.uuid4()), 1, 7]).encode()),
    _b64(json.dumps(["2026-01-01T00:00:00Z", str(uuid.uuid4()), 1, "a\x00"]).encode()),
    _b64(b"[" * 100000 + b"]" * 100000),          # deep nesting
])
def test_malformed_cursors_are_400(cursor: str) -> None:
    with pytest.raises(Problem) as caught:
        decode_cursor({"cursor": cursor}, KINDS)
    assert caught.value.status == 400
    assert caught.value.code == "invalid_cursor"
    assert caught.value.extra == {"field": "cursor"}


def test_make_page_sets_the_cursor_only_when_more_rows_exist() -> None:
    rows = [(i,) for i in range(5)]
    items, nxt = make_page(rows, 5, lambda r: [r[0]])
    assert items == rows and nxt is None
    items, nxt = make_page(rows, 4, lambda r: [r[0]])
    assert items == rows[:4]
    assert decode_cursor({"cursor": nxt}, ("int",)) == [3]
    assert make_page([], 10, lambda r: [r]) == ([], None)


def test_limit_is_checked_not_clamped() -> None:
    schema = page_query()
    assert page_limit({}) == DEFAULT_LIMIT
    assert check(schema["limit"], 100) == 100
    for bad in (0, 101, -1):
        with pytest.raises(Problem) as caught:
            check(schema["limit"], bad, "limit")
        assert caught.value.status == 400


def test_encode_refuses_what_it_cannot_decode() -> None:
    with pytest.raises(ValueError, match="time zone"):
        encode_cursor([dt.datetime(2026, 1, 1)])
    with pytest.raises(TypeError):
        encode_cursor([1.5])
    with pytest.raises(TypeError):
        encode_cursor([True])
