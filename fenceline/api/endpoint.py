"""How an endpoint is declared, and the one path every API request takes.

An endpoint is declared once, with everything a client needs to know about it: method and
path, the role it needs on which entity, its body and query schemas, its answers, and the
audit action it writes. The same declaration drives the request path below, the OpenAPI
document (fenceline/api/openapi.py), docs/API.md and the roles matrix test, so none of them
can drift from what the code does.

The request path, in order (each step's failure wins over the later ones):
parse path ids (400) -> read and validate the body and query (400/413) -> BEGIN with one
statement that finds the caller by token hash (401) and the addressed entity and the caller's
role in one join (404 for non-members, 403 below the role) -> the handler -> the audit row
and COMMIT.
Serialization failures and deadlocks re-run the whole transaction (at most five tries).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import logging
import random
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import psycopg.errors
import trio
from quart import Blueprint, Response, current_app, g, request
from werkzeug.datastructures import Headers

from fenceline.api import auth, authz
from fenceline.api.auth import Caller
from fenceline.api.authz import Scope
from fenceline.api.problems import Problem
from fenceline.api.validation import INT64_MAX, Schema, check, invalid
from fenceline.db.pool import PoolTimeout
from fenceline.engine.calls import EngineInputError
from fenceline.readiness import Readiness

log = logging.getLogger("fenceline.api")

PREFIX = "/api/v1"
MAX_TRIES = 5

# Errors every authenticated endpoint can answer, besides its own.
STANDARD_PROBLEMS = (400, 401, 404, 413, 503)


@dataclass
class Reply:
    status: int
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Call:
    """One request as a handler sees it: validated input, the caller, the transaction."""

    conn: psycopg.AsyncConnection[Any]
    caller: Caller | None
    scope: Scope | None
    params: dict[str, Any]
    body: Any
    query: dict[str, Any]
    headers: Headers           # case-insensitive
    request_id: str
    # The audit row: the handler may name the entity it created and add detail.
    audit_entity_id: str | None = None
    audit_detail: dict[str, Any] = field(default_factory=dict)
    audit_scope: Scope | None = None

    @property
    def user_id(self) -> uuid.UUID:
        assert self.caller is not None and self.caller.user_id is not None
        return self.caller.user_id

    async def resolve(self, kind: str, entity_id: Any, needed: str) -> Scope:
        """Authorise against an entity named in the body or query rather than the path."""
        assert self.caller is not None
        return await authz.resolve(self.conn, self.caller, kind, entity_id, needed)


Handler = Callable[[Call], Awaitable[Reply]]


@dataclass
class Direct:
    """One request as a direct handler sees it: validated input, nothing sent yet.

    A direct handler answers the whole request with one statement of its own (authorisation,
    the change and the audit row, committed as one implicit transaction) and must give the
    same answers, in the same order, as the endpoint's ordinary path. It returns None, having
    sent nothing, to leave a request to the ordinary path.
    """

    endpoint: Endpoint
    conn: psycopg.AsyncConnection[Any]
    token: str | None
    params: dict[str, Any]
    body: Any
    query: dict[str, Any]
    headers: Headers
    request_id: str


DirectHandler = Callable[[Direct], Awaitable[Reply | None]]


@dataclass
class Endpoint:
    method: str
    path: str                       # OpenAPI style, without the /api/v1 prefix
    summary: str
    tag: str
    handler: Handler
    role: str | None                # None = anonymous; "user" = any session; else a role
    scope: tuple[str, str] | None   # (entity kind, path parameter) the role applies to
    body: Schema | None
    query: dict[str, Schema]
    responses: dict[int, Schema | None]
    problems: tuple[int, ...]
    audit: str | None
    users_only: bool                # API keys may not call it
    direct: DirectHandler | None = None   # one statement for the whole request (see Direct)

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"{(\w+)}", self.path)

    def param_schema(self, name: str) -> Schema:
        if name == "job_id":
            return {"type": "integer", "minimum": 1, "maximum": INT64_MAX}
        return {"type": "string", "format": "uuid"}

    @property
    def all_problems(self) -> tuple[int, ...]:
        base = {400, 413, 503}
        if self.role is not None:
            base.add(401)
        if self.scope is not None:
            base |= {403, 404}
        if self.users_only:
            base.add(403)
        return tuple(sorted(base | set(self.problems)))


class Resource:
    """One module's endpoints: a Quart blueprint plus their declarations."""

    def __init__(self, name: str, tag: str) -> None:
        self.blueprint = Blueprint(name, __name__)
        self.tag = tag
        self.endpoints: list[Endpoint] = []

    def route(self, method: str, path: str, *, summary: str, role: str | None,
              scope: tuple[str, str] | None = None, body: Schema | None = None,
              query: dict[str, Schema] | None = None,
              responses: dict[int, Schema | None], problems: tuple[int, ...] = (),
              audit: str | None = None, users_only: bool = False,
              direct: DirectHandler | None = None,
              ) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            ep = Endpoint(method, path, summary, self.tag, handler, role, scope, body,
                          query or {}, responses, problems, audit, users_only, direct)
            self.endpoints.append(ep)
            quart_path = PREFIX + re.sub(r"{(\w+)}", r"<\1>", path)

            async def view(**path_values: str) -> Response:
                return await _serve(ep, path_values)

            view.__name__ = handler.__name__
            self.blueprint.add_url_rule(quart_path, handler.__name__, view, methods=[method])
            return handler
        return register


# -- the request path --------------------------------------------------------------------


async def _serve(ep: Endpoint, path_values: dict[str, str]) -> Response:
    params = {name: _parse_param(ep, name, raw) for name, raw in path_values.items()}
    query = _read_query(ep)
    body = await _read_body(ep)
    readiness: Readiness = current_app.config["FENCELINE_READINESS"]
    pool = readiness.pool
    if pool is None:
        raise Problem(503, "unavailable", "Unavailable", "the database is not ready",
                      headers={"Retry-After": "1"})
    token = auth.bearer_token(request.headers.get("Authorization"))
    request_id = str(g.request_id)
    for attempt in range(MAX_TRIES):
        try:
            # One transaction per request, begun and ended by _handle; a request that fails
            # leaves it open or failed, and the pool's checkin rolls it back (shielded).
            async with pool.connection() as conn:
                reply = await _handle(ep, conn, token, params, body, query, request_id)
            return render(reply)
        except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
            if attempt == MAX_TRIES - 1:
                raise Problem(503, "contention", "Unavailable",
                              "the database was too busy; try again",
                              headers={"Retry-After": "1"}) from None
            delay = 0.02 * 2**attempt
            await trio.sleep(random.uniform(delay / 2, delay))
        except psycopg.Error as exc:
            raise database_problem(exc) from None
        except EngineInputError as exc:
            raise engine_problem(exc) from None
    raise AssertionError("unreachable")


async def _handle(ep: Endpoint, conn: psycopg.AsyncConnection[Any], token: str | None,
                  params: dict[str, Any], body: Any, query: dict[str, Any],
                  request_id: str) -> Reply:
    if ep.direct is not None:
        direct = await ep.direct(Direct(ep, conn, token, params, body, query, request.headers,
                                        request_id))
        if direct is not None:
            return direct
    caller: Caller | None = None
    scope: Scope | None = None
    if ep.role is not None:
        # BEGIN, the token lookup and the authorisation join: one round trip.
        target = None if ep.scope is None else (ep.scope[0], params[ep.scope[1]])
        caller, scope = await authz.authorise(conn, token, target, ep.role,
                                              users_only=ep.users_only, prefix="begin; ")
    else:
        await conn.execute("begin")
    call = Call(conn, caller, scope, params, body, query, request.headers, request_id)
    reply = await ep.handler(call)
    # The audit row and COMMIT: one round trip (the INSERT fails -> no COMMIT is run).
    await _commit(conn, _audit_sql(call, ep) if ep.audit is not None else "")
    return reply


async def _commit(conn: psycopg.AsyncConnection[Any], before: str = "") -> None:
    """``before`` (SQL, values as literals) then COMMIT, sent as one simple-protocol query.

    Refuse to report success for a transaction that had already failed: PostgreSQL answers
    a COMMIT of one with ROLLBACK and no error.
    """
    if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
        raise psycopg.InternalError("the request's transaction is not open at commit")
    cur = await conn.execute(before + "commit")
    if before:
        cur.nextset()
    if cur.statusmessage != "COMMIT":
        raise psycopg.InternalError(f"COMMIT answered {cur.statusmessage}")


def _audit_sql(call: Call, ep: Endpoint) -> str:
    """The audit row's INSERT with its values bound client-side, ending in '; '."""
    scope = call.audit_scope or call.scope
    if scope is None or call.caller is None or ep.audit is None:
        raise AssertionError(f"{ep.path}: an audited endpoint must know its scope")
    entity_id = call.audit_entity_id or scope.entity_id
    return psycopg.AsyncClientCursor(call.conn).mogrify(
        "insert into fl.audit_log (org_id, project_id, actor_user, actor_key, action, entity,"
        "                          entity_id, detail, request_id)"
        " values (%s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s); ",
        (scope.org_id, scope.project_id, call.caller.user_id, call.caller.key_id, ep.audit,
         ep.audit.split(".")[0], entity_id, json.dumps(call.audit_detail, default=_json_default),
         call.request_id))


def _parse_param(ep: Endpoint, name: str, raw: str) -> Any:
    schema = ep.param_schema(name)
    if schema.get("type") == "integer":
        if not raw.isdigit() or not 1 <= int(raw) <= INT64_MAX:
            raise invalid(name, "must be a positive integer id")
        return int(raw)
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise invalid(name, "must be a UUID") from None


def _read_query(ep: Endpoint) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in request.args:
        if name not in ep.query:
            raise invalid(name, "is not a known query parameter")
        values = request.args.getlist(name)
        if len(values) > 1:
            raise invalid(name, "must be given once")
        out[name] = check(ep.query[name], _coerce_query(ep.query[name], values[0], name), name)
    return out


def _coerce_query(schema: Schema, raw: str, name: str) -> Any:
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "integer" in kinds:
        try:
            return int(raw)
        except ValueError:
            raise invalid(name, "must be an integer") from None
    if "boolean" in kinds:
        if raw not in ("true", "false"):
            raise invalid(name, "must be true or false")
        return raw == "true"
    return raw


async def _read_body(ep: Endpoint) -> Any:
    raw = await request.get_data()
    if ep.body is None:
        if raw.strip() not in (b"", b"{}"):
            raise invalid("body", "this endpoint takes no body")
        return None
    if not raw.strip():
        value: Any = {}
    else:
        try:
            value = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            raise Problem(400, "invalid_json", "Invalid JSON",
                          "the body is not valid JSON") from None
    return check(ep.body, value)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def request_id_of() -> str:
    given = request.headers.get("X-Request-Id", "").strip()
    if given and len(given) <= 200 and given.isprintable():
        return given
    return str(uuid.uuid4())


# -- answers -----------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot serialise {type(value).__name__}")


def dumps(value: Any) -> str:
    return json.dumps(value, default=_json_default)


def render(reply: Reply) -> Response:
    if reply.status == 204 or reply.body is None:
        return Response(b"", status=reply.status, headers=reply.headers)
    return Response(dumps(reply.body), status=reply.status, headers=reply.headers,
                    content_type="application/json")


# -- database errors as problems ---------------------------------------------------------


def engine_problem(exc: EngineInputError) -> Problem:
    if exc.sqlstate == "FL002":
        return Problem(413, "payload_too_large", "Payload too large", str(exc))
    return Problem(400, "invalid_input", "Invalid input", str(exc))


def database_problem(exc: psycopg.Error) -> Problem:
    """A database error no handler mapped: a clear 4xx where it is the client's, else 503."""
    state = exc.sqlstate or ""
    message = exc.diag.message_primary or type(exc).__name__
    # First: psycopg classes our own SQLSTATE class FL as an OperationalError.
    if state.startswith("FL"):
        return engine_problem(EngineInputError(state, message))
    if isinstance(exc, PoolTimeout | psycopg.OperationalError | psycopg.errors.QueryCanceled):
        log.warning("database unavailable during a request: %s", exc)
        return Problem(503, "unavailable", "Unavailable", "the database is unavailable",
                       headers={"Retry-After": "1"})
    if state == "23505":
        return Problem(409, "conflict", "Conflict", "that name or key is already in use")
    if state.startswith("23"):
        constraint = exc.diag.constraint_name or "a constraint"
        return Problem(400, "invalid_input", "Invalid input",
                       f"the values break {constraint}")
    if state.startswith("22"):
        return Problem(400, "invalid_input", "Invalid input", message)
    raise exc
