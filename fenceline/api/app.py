"""The quart-trio application: resources under /api/v1, problem+json for every error."""

from __future__ import annotations

import logging

from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from fenceline.api import (
    accounts,
    api_keys,
    audit,
    dead_letters,
    events,
    health,
    jobs,
    openapi,
    orgs,
    policies,
    projects,
    queues,
    statements,
    stream,
    submission,
    workers,
)
from fenceline.api.endpoint import Resource, request_id_of
from fenceline.api.passwords import Passwords
from fenceline.api.problems import Problem, from_http_exception, problem_response
from fenceline.config import Settings
from fenceline.readiness import Readiness

log = logging.getLogger("fenceline.api")

# A batch of 1,000 jobs with modest payloads fits; one job's payload is limited to 256 KiB
# by the engine.
MAX_BODY_BYTES = 4 * 1024 * 1024

# Every resource module, in the order the OpenAPI document lists them.
RESOURCES: list[Resource] = [
    accounts.resource,
    submission.resource,
    orgs.resource, projects.resource, policies.resource, queues.resource, api_keys.resource,
    audit.resource,
    jobs.resource, dead_letters.resource, workers.resource,
    events.resource,
]


def create_app(readiness: Readiness, settings: Settings | None = None) -> QuartTrio:
    settings = settings or Settings()
    app = QuartTrio("fenceline")
    app.config["FENCELINE_READINESS"] = readiness
    app.config["FENCELINE_SETTINGS"] = settings
    app.config["FENCELINE_PASSWORDS"] = Passwords(settings.password_profile)
    statements.set_enabled(settings.api_prepare == "on")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["JSON_SORT_KEYS"] = False
    app.register_blueprint(health.blueprint)
    app.register_blueprint(openapi.blueprint)
    for resource in RESOURCES:
        app.register_blueprint(resource.blueprint)
    stream.install(app)

    @app.before_request
    async def assign_request_id_and_read_body() -> None:
        g.request_id = request_id_of()
        # Read the whole body before anything can answer (405, 400 on a path id...): a body
        # left unread on a keep-alive connection stalls the next request on it (found by
        # schemathesis; hypercorn 0.18 with h11). Bodies are capped, so this is bounded.
        await request.get_data()

    @app.after_request
    async def echo_request_id(response: Response) -> Response:
        response.headers["X-Request-Id"] = _request_id()
        return response

    @app.errorhandler(Problem)
    async def on_problem(problem: Problem) -> Response:
        return problem_response(problem, _request_id())

    @app.errorhandler(HTTPException)
    async def on_http_exception(exc: HTTPException) -> Response:
        return problem_response(from_http_exception(exc), _request_id())

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception) -> Response:
        log.exception("unhandled error in request", extra={"request_id": _request_id()})
        return problem_response(Problem(500, "internal_error", "Internal Server Error"),
                                _request_id())

    return app


def _request_id() -> str:
    rid = getattr(g, "request_id", None)
    if rid is None:
        rid = g.request_id = request_id_of() if request else ""
    return str(rid)
