"""The quart-trio application: blueprints, problem+json for every error, size limits."""

from __future__ import annotations

import logging

from quart import Response
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from fenceline.api import health
from fenceline.api.problems import Problem, from_http_exception, problem_response
from fenceline.readiness import Readiness

log = logging.getLogger("fenceline.api")

MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(readiness: Readiness) -> QuartTrio:
    app = QuartTrio("fenceline")
    app.config["FENCELINE_READINESS"] = readiness
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["JSON_SORT_KEYS"] = False
    app.register_blueprint(health.blueprint)

    @app.errorhandler(Problem)
    async def on_problem(problem: Problem) -> Response:
        return problem_response(problem)

    @app.errorhandler(HTTPException)
    async def on_http_exception(exc: HTTPException) -> Response:
        return problem_response(from_http_exception(exc))

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception) -> Response:
        log.exception("unhandled error in request")
        return problem_response(Problem(500, "internal_error", "Internal Server Error"))

    return app
