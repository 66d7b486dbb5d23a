"""The event stream over a websocket: replay from a cursor, then live, re-authorised as it goes.

``GET /api/v1/projects/{project_id}/events/stream?after=<cursor>|tail`` (viewer). The same
positions as the HTTP list (fenceline/api/events.py): no ``after`` = the oldest retained
event, ``after=tail`` = the current end.

**Before the upgrade** every refusal is a plain HTTP problem+json answer: 400 (bad project
id, bad cursor, unknown query parameter, subprotocols without ``fl.v1``), 403
``origin_not_allowed``, 401, 404 (not a member or no such project), 403 (role), 410
``cursor_too_old`` (with ``oldest``), 429 ``too_many_streams`` (``Retry-After: 30``; at most
four open streams per user or API key on one API process), 503.

**Authentication**: ``Authorization: Bearer <token>``, or, for browsers, which cannot set
headers, the subprotocol ``fl.token.<token>``. The server never echoes the token subprotocol
(the answer's headers end up in logs and proxies): a client that offers any subprotocol must
offer ``fl.v1`` too, and ``fl.v1`` is the one accepted; ``new WebSocket(url, ["fl.v1",
"fl.token." + token])``. Offering subprotocols without ``fl.v1`` is a 400
``subprotocol_required`` (a browser would otherwise fail the handshake with no reason given).

**Origin**: a request with an ``Origin`` header must match ``API_ALLOWED_ORIGINS`` (``*``
matches anything but ``/``), or, when that is empty, its host and port must equal the
``Host`` header (the scheme is not compared: TLS may end at a proxy). No ``Origin`` (not a
browser) is allowed; the token is the protection there.

**Frames** (JSON text, server to client):

* ``{"type": "ready", "cursor": C}`` once, after the upgrade: where the stream starts (the
  resolved position for ``tail``; reconnecting with ``after=C`` misses nothing).
* ``{"type": "batch", "prev": C1, "next": C2, "events": [...]}``: at most 1,000 events, the
  same objects as the HTTP list (hot-path events list many jobs in ``payload.jobs``, passed
  through). ``prev`` equals the previous frame's ``next`` (or the ready cursor): a client that
  sees otherwise missed a frame and reconnects with ``after=<last next it trusts>``.
* ``{"type": "ping"}`` after 20 s without a frame, so that idle proxies and clients can tell
  a quiet stream from a dead one (reference W12).
* ``{"type": "cursor_too_old", "oldest": C}`` when retention overtakes a lagging stream,
  then a close.

**Close codes**: 4001 the session or key was revoked or expired; 4003 the caller may no
longer read the project (membership removed or role lowered); 4010 cursor too old; 1008 the
client sent a data message (the stream takes none); 1011 the database is unavailable
(reconnect with the last ``next``). A frame write that takes longer than 10 s ends the stream
without a close frame. hypercorn shields its socket writes from cancellation
(hypercorn/trio/tcp_server.py), so a client that stops reading entirely is dropped by the
kernel instead: the API's listening sockets set TCP_USER_TIMEOUT (fenceline/api/server.py,
20 s), which aborts a connection whose data stays unsent behind a zero window, and the
stream's task and slot go with it (tests/api/test_stream_slow_client.py).

**Delivery**: the stream reads, in one transaction per cycle, the caller's session and role
(so a logout or a removed membership ends the stream within one cycle, reference W12) and up
to 1,000 events. A cycle runs every second, and sooner on a wake-up: while at least one
stream is open the process holds one LISTEN connection (fenceline/db/listener.py) on
``fl_queue``, which every state change that may concern a worker notifies at commit, and on
``fl_events``, which a completion on a queue without a cap notifies instead (migration 0011:
it concerns no worker); any notification wakes every stream (at most one cycle per stream
per 50 ms). A lost notification costs at most a second.
An event is readable only once every older writing transaction has ended (events.py); when a
cycle finds committed events still waiting behind one, it looks again after 50 ms, 100 ms,
... up to the poll interval, since that transaction's end may notify nothing.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import psycopg
import trio
from quart import Blueprint, Response, current_app, websocket
from quart_trio import QuartTrio

from fenceline.api import auth, authz, events
from fenceline.api.auth import Caller
from fenceline.api.endpoint import PREFIX, database_problem, dumps
from fenceline.api.problems import Problem, problem_response
from fenceline.api.validation import invalid
from fenceline.config import Settings
from fenceline.db.listener import Listener
from fenceline.db.pool import Pool
from fenceline.readiness import Readiness

log = logging.getLogger("fenceline.api")

blueprint = Blueprint("event_stream", __name__)

SUBPROTOCOL = "fl.v1"
TOKEN_SUBPROTOCOL = "fl.token."
MAX_STREAMS = 4               # per user or API key, per API process
RETRY_AFTER = "30"
FRAME_EVENTS = 1000
# Workers' wake-ups, and completions no worker needs (0011): every stream wakes on either.
CHANNELS = ("fl_queue", "fl_events")

CLOSE_UNAUTHENTICATED = 4001
CLOSE_FORBIDDEN = 4003
CLOSE_CURSOR_TOO_OLD = 4010
CLOSE_POLICY = 1008
CLOSE_UNAVAILABLE = 1011


@dataclass
class StreamTiming:
    poll: float = 1.0           # seconds between cycles without a wake-up
    heartbeat: float = 20.0     # a ping frame after this long without a frame
    send_timeout: float = 10.0  # a client that does not take a frame in this long is dropped
    min_gap: float = 0.05       # at most one cycle per stream this often, however many wake-ups


class Hub:
    """The process's open streams: the per-caller count and the shared wake-up."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        self._pulse = trio.Event()
        self._listening: trio.CancelScope | None = None

    @property
    def pulse(self) -> trio.Event:
        """Set at the next wake-up; take it before reading so no wake-up falls in between."""
        return self._pulse

    @property
    def listening(self) -> bool:
        """Whether the LISTEN connection is held (only while streams are open)."""
        return self._listening is not None

    def wake(self) -> None:
        self._pulse.set()
        self._pulse = trio.Event()

    def admit(self, who: str) -> bool:
        if self.open.get(who, 0) >= MAX_STREAMS:
            return False
        self.open[who] = self.open.get(who, 0) + 1
        return True

    def leave(self, who: str) -> None:
        left = self.open.get(who, 0) - 1
        if left > 0:
            self.open[who] = left
        else:
            self.open.pop(who, None)
        if not self.open:
            self.stop()

    def listen(self, nursery: trio.Nursery | None, conninfo: str) -> None:
        """Hold one LISTEN connection while streams are open (none without a nursery)."""
        if self._listening is None and nursery is not None:
            self._listening = trio.CancelScope()
            nursery.start_soon(self._listen, self._listening, conninfo)

    def stop(self) -> None:
        if self._listening is not None:
            self._listening.cancel()
            self._listening = None

    async def _listen(self, scope: trio.CancelScope, conninfo: str) -> None:
        try:
            with scope:
                listener = Listener(conninfo, name="api-events")
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(listener.run)
                    for channel in CHANNELS:
                        nursery.start_soon(self._wake_on, listener, channel)
        except Exception:
            # Wake-ups are an optimisation: streams still poll every cycle.
            log.exception("event stream wake-ups stopped; streams fall back to polling")
        finally:
            if self._listening is scope:
                self._listening = None

    async def _wake_on(self, listener: Listener, channel: str) -> None:
        with listener.subscribe(channel, buffer=1) as wakeups:
            async for _ in wakeups:
                self.wake()


def install(app: QuartTrio) -> None:
    """Serve the stream on ``app``."""
    app.config.setdefault("FENCELINE_STREAM_TIMING", StreamTiming())
    hub = app.config["FENCELINE_STREAM_HUB"] = Hub()
    app.register_blueprint(blueprint)

    @app.after_serving
    async def stop_listening() -> None:
        hub.stop()


# -- checks before the upgrade -----------------------------------------------------------


def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile("[^/]*".join(re.escape(part) for part in pattern.lower().split("*")))


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a browser page from ``origin`` may open a stream."""
    if origin is None:
        return True
    origin = origin.strip().lower().rstrip("/")
    if allowed:
        return any(_glob(p).fullmatch(origin) for p in allowed)
    parts = urlsplit(origin)
    return (parts.scheme in ("http", "https") and bool(parts.netloc)
            and parts.netloc == (host or "").strip().lower())


def credentials(authorization: str | None, offered: list[str]) -> tuple[str | None, str | None]:
    """The token (header first, then a ``fl.token.`` subprotocol) and the subprotocol to
    accept (``fl.v1``, never the token)."""
    offered = [p.strip() for p in offered]
    token = auth.bearer_token(authorization)
    if token is None:
        token = next((p[len(TOKEN_SUBPROTOCOL):] for p in offered
                      if p.startswith(TOKEN_SUBPROTOCOL) and len(p) > len(TOKEN_SUBPROTOCOL)),
                     None)
    if not offered:
        return token, None
    if SUBPROTOCOL not in offered:
        raise Problem(400, "subprotocol_required", "Subprotocol required",
                      f"offer the subprotocol '{SUBPROTOCOL}' (next to "
                      f"'{TOKEN_SUBPROTOCOL}<token>'); the server never echoes a token")
    return token, SUBPROTOCOL


def _caller_key(caller: Caller) -> str:
    return f"user:{caller.user_id}" if caller.is_user else f"key:{caller.key_id}"


@dataclass
class Stream:
    """An admitted stream: who, where, and from which position."""

    pool: Pool
    token: str | None
    project_id: uuid.UUID
    who: str
    start: events.Position
    subprotocol: str | None
    timing: StreamTiming
    hub: Hub
    request_id: str


async def _admit(project_id: str, request_id: str) -> Stream:
    settings: Settings = current_app.config["FENCELINE_SETTINGS"]
    readiness: Readiness = current_app.config["FENCELINE_READINESS"]
    hub: Hub = current_app.config["FENCELINE_STREAM_HUB"]
    try:
        project = uuid.UUID(project_id)
    except ValueError:
        raise invalid("project_id", "must be a UUID") from None
    for name in websocket.args:
        if name != "after":
            raise invalid(name, "is not a known query parameter")
    if len(websocket.args.getlist("after")) > 1:
        raise invalid("after", "must be given once")
    raw = websocket.args.get("after")
    if raw is not None and raw != events.TAIL:
        events.decode(raw)
    if not origin_allowed(websocket.headers.get("Origin"), websocket.headers.get("Host"),
                          settings.api_allowed_origins):
        raise Problem(403, "origin_not_allowed", "Origin not allowed",
                      "this page's origin may not open the event stream "
                      "(see API_ALLOWED_ORIGINS)")
    token, subprotocol = credentials(websocket.headers.get("Authorization"),
                                     websocket.requested_subprotocols)
    pool = readiness.pool
    if pool is None:
        raise Problem(503, "unavailable", "Unavailable", "the database is not ready",
                      headers={"Retry-After": "1"})
    try:
        async with pool.connection() as conn, conn.transaction():
            caller, _ = await authz.authorise(conn, token, ("project", project), "viewer")
            start = await events.start(conn, project, raw)
            oldest = await events.low_water(conn, project)
    except psycopg.Error as exc:
        raise database_problem(exc) from None
    if oldest is not None and start < oldest:
        raise events.CursorTooOld(oldest)
    who = _caller_key(caller)
    if not hub.admit(who):
        raise Problem(429, "too_many_streams", "Too many streams",
                      f"at most {MAX_STREAMS} open event streams per user on one server; "
                      "close one first", headers={"Retry-After": RETRY_AFTER})
    return Stream(pool, token, project, who, start, subprotocol,
                  current_app.config["FENCELINE_STREAM_TIMING"], hub, request_id)


@blueprint.websocket(PREFIX + "/projects/<project_id>/events/stream")
async def event_stream(project_id: str) -> Response | None:
    given = websocket.headers.get("X-Request-Id", "").strip()
    request_id = given if given and len(given) <= 200 and given.isprintable() else str(
        uuid.uuid4())
    try:
        stream = await _admit(project_id, request_id)
    except Problem as problem:
        response = problem_response(problem, request_id)
        response.headers["X-Request-Id"] = request_id
        return response
    # Nothing may come between admit and this try: leave() must match admit().
    try:
        stream.hub.listen(getattr(current_app, "nursery", None), stream.pool.conninfo)
        await _serve(websocket._get_current_object(), stream)  # type: ignore[attr-defined]
    finally:
        stream.hub.leave(stream.who)
    return None


# -- the stream --------------------------------------------------------------------------


class _Close(Exception):
    """End the stream with this close code (None: drop the connection, no close frame)."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class _Ending:
    scope: trio.CancelScope
    close: _Close | None = field(default=None)

    def end(self, close: _Close) -> None:
        if self.close is None:
            self.close = close
        self.scope.cancel()


async def _serve(ws: Any, stream: Stream) -> None:
    await ws.accept(headers={"X-Request-Id": stream.request_id},
                    subprotocol=stream.subprotocol)
    async with trio.open_nursery() as nursery:
        ending = _Ending(nursery.cancel_scope)
        nursery.start_soon(_refuse_messages, ws, ending)
        nursery.start_soon(_deliver, ws, stream, ending)
    close = ending.close
    if close is not None and close.code is not None:
        with trio.move_on_after(stream.timing.send_timeout):
            await ws.close(close.code, close.reason)


async def _refuse_messages(ws: Any, ending: _Ending) -> None:
    await ws.receive()
    ending.end(_Close(CLOSE_POLICY, "this stream takes no messages"))


async def _deliver(ws: Any, stream: Stream, ending: _Ending) -> None:
    try:
        await _pump(ws, stream)
    except _Close as close:
        ending.end(close)
    except Exception:
        log.exception("event stream failed", extra={"request_id": stream.request_id})
        ending.end(_Close(CLOSE_UNAVAILABLE, "internal error; reconnect with the last next"))


async def _send(ws: Any, stream: Stream, frame: dict[str, Any]) -> None:
    with trio.move_on_after(stream.timing.send_timeout) as scope:
        await ws.send(dumps(frame))
    if scope.cancelled_caught:
        # A half-written frame leaves nothing sane to send: drop the connection.
        raise _Close(None, "the client did not read")


async def _pump(ws: Any, stream: Stream) -> None:
    timing = stream.timing
    position = stream.start
    await _send(ws, stream, {"type": "ready", "cursor": position.encode()})
    last_frame = trio.current_time()
    retry = timing.min_gap
    while True:
        pulse = stream.hub.pulse
        began = trio.current_time()
        page = await _cycle(ws, stream, position)
        if page.events:
            await _send(ws, stream, {"type": "batch", "prev": position.encode(),
                                     "next": page.next.encode(), "events": page.events})
            position = page.next
            last_frame = trio.current_time()
            if len(page.events) == FRAME_EVENTS:
                continue                      # more are waiting: no pause
        elif trio.current_time() - last_frame >= timing.heartbeat:
            await _send(ws, stream, {"type": "ping"})
            last_frame = trio.current_time()
        if page.pending:
            # Committed events wait behind an older transaction, whose end may notify
            # nothing (it may not even be in this database): look again soon, backing off.
            wake_at = began + retry
            retry = min(retry * 2, timing.poll)
        else:
            wake_at = began + timing.poll
            retry = timing.min_gap
        with trio.move_on_at(min(wake_at, last_frame + timing.heartbeat)):
            await pulse.wait()
        await trio.sleep(max(0.0, began + timing.min_gap - trio.current_time()))


async def _cycle(ws: Any, stream: Stream, position: events.Position) -> events.Page:
    """Re-authorise, then read: one transaction."""
    try:
        async with stream.pool.connection() as conn, conn.transaction():
            try:
                await authz.authorise(conn, stream.token, ("project", stream.project_id),
                                      "viewer")
            except Problem as refused:
                if refused.status == 401:
                    raise _Close(CLOSE_UNAUTHENTICATED,
                                 "the session or key was revoked or has expired") from None
                raise _Close(CLOSE_FORBIDDEN,
                             "you may no longer read this project's events") from None
            try:
                return await events.read(conn, stream.project_id, position, FRAME_EVENTS)
            except events.CursorTooOld as exc:
                too_old = exc
    except psycopg.Error as exc:
        log.warning("event stream lost the database: %s", exc,
                    extra={"request_id": stream.request_id})
        raise _Close(CLOSE_UNAVAILABLE,
                     "the database is unavailable; reconnect with the last next") from None
    await _send(ws, stream, {"type": "cursor_too_old", "oldest": too_old.oldest.encode()})
    raise _Close(CLOSE_CURSOR_TOO_OLD, "events after this stream's position were dropped")
