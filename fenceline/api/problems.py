"""Errors as ``application/problem+json`` (RFC 9457) with a stable machine-readable code.

Handlers raise ``Problem``; the app turns it, and every HTTP error Quart raises itself
(unknown path, wrong method, oversize body), into the same body shape. A client can switch
on ``code`` without parsing ``title`` or ``detail``, which are for people.
"""

from __future__ import annotations

import json
from typing import Any

from quart import Response
from werkzeug.exceptions import HTTPException

PROBLEM_JSON = "application/problem+json"

# Quart/werkzeug status codes mapped to our stable codes.
_HTTP_CODES = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "unprocessable",
    429: "rate_limited",
    500: "internal_error",
    503: "unavailable",
}


class Problem(Exception):
    """An error answer. ``code`` is part of the API contract; never rename one."""

    def __init__(self, status: int, code: str, title: str, detail: str | None = None, *,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(detail or title)
        self.status = status
        self.code = code
        self.title = title
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": f"https://fenceline.dev/problems/{self.code}",
            "title": self.title,
            "status": self.status,
            "code": self.code,
        }
        if self.detail is not None:
            body["detail"] = self.detail
        body.update(self.extra)
        return body


def problem_response(problem: Problem, request_id: str | None = None) -> Response:
    body = problem.body()
    if request_id is not None:
        body["request_id"] = request_id
    return Response(json.dumps(body, default=str), status=problem.status,
                    headers=problem.headers, content_type=PROBLEM_JSON)


def from_http_exception(exc: HTTPException) -> Problem:
    status = exc.code or 500
    code = _HTTP_CODES.get(status, "http_error")
    title = exc.name if status != 500 else "Internal Server Error"
    detail = exc.description if status != 500 else None
    return Problem(status, code, title, detail)
