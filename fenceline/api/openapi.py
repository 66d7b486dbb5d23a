"""The OpenAPI 3.1 document and the endpoint reference of docs/API.md, made from the code.

Both come from the endpoint declarations (fenceline/api/endpoint.py), so they list exactly
the routes the app serves, with the schemas the app enforces. ``python -m
fenceline.api.openapi --write-docs`` rewrites the generated part of docs/API.md; a test fails
when it is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from quart import Blueprint

from fenceline import __version__
from fenceline.api.endpoint import PREFIX, Endpoint, Resource
from fenceline.api.problems import PROBLEM_JSON
from fenceline.api.validation import Schema, integer, obj, string

blueprint = Blueprint("openapi", __name__)

PROBLEM: Schema = obj({
    "type": string(), "title": string(), "status": integer(100, 599), "code": string(),
    "detail": string(), "request_id": string(), "field": string(),
}, ["type", "title", "status", "code"], additional=True)

REASONS = {200: "OK", 201: "Created", 202: "Accepted", 204: "No Content",
           400: "Invalid input", 401: "Missing, unknown, expired or revoked token",
           403: "Member, but the role is too low", 404: "Not found, or not yours",
           409: "Conflict with the current state", 410: "Gone", 413: "Body too large",
           429: "Too many requests", 503: "Database unavailable"}

# Routes that are not declared endpoints (plain Quart views), with their documentation.
_PLAIN: dict[str, dict[str, Any]] = {
    "/healthz": {"get": {"summary": "The process answers", "operationId": "healthz",
                         "tags": ["Health"], "responses": {"200": {"description": "OK"}}}},
    "/readyz": {"get": {"summary": "The process can do its work (database reachable and "
                                   "migrated)", "operationId": "readyz", "tags": ["Health"],
                        "responses": {"200": {"description": "Ready"},
                                      "503": {"description": "Not ready", "content": {
                                          PROBLEM_JSON: {"schema": PROBLEM}}}}}},
    PREFIX + "/openapi.json": {"get": {"summary": "This document", "operationId": "openapi",
                                       "tags": ["Meta"],
                                       "responses": {"200": {"description": "OpenAPI 3.1"}}}},
}


def _operation(ep: Endpoint) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": ep.handler.__name__, "summary": ep.summary,
                          "tags": [ep.tag]}
    params = [{"name": name, "in": "path", "required": True, "schema": ep.param_schema(name)}
              for name in ep.path_params]
    params += [{"name": name, "in": "query", "required": False, "schema": schema}
               for name, schema in ep.query.items()]
    if params:
        op["parameters"] = params
    if ep.body is not None:
        op["requestBody"] = {"required": bool(ep.body.get("required")),
                             "content": {"application/json": {"schema": ep.body}}}
    responses: dict[str, Any] = {}
    for status, schema in sorted(ep.responses.items()):
        answer: dict[str, Any] = {"description": REASONS.get(status, "OK")}
        if schema is not None:
            answer["content"] = {"application/json": {"schema": schema}}
        responses[str(status)] = answer
    for status in ep.all_problems:
        responses.setdefault(str(status), {
            "description": REASONS.get(status, "Error"),
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}})
    op["responses"] = responses
    if ep.role is not None:
        op["security"] = [{"bearer": []}]
    op["x-fenceline-role"] = ep.role or "anonymous"
    if ep.audit:
        op["x-fenceline-audit"] = ep.audit
    return op


def document(resources: list[Resource]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {path: dict(ops) for path, ops in _PLAIN.items()}
    for resource in resources:
        for ep in resource.endpoints:
            paths.setdefault(PREFIX + ep.path, {})[ep.method.lower()] = _operation(ep)
    return {
        "openapi": "3.1.0",
        "info": {"title": "fenceline", "version": __version__,
                 "description": "A PostgreSQL-backed job scheduler. Errors are "
                                "application/problem+json with a stable `code`."},
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": {"Problem": PROBLEM},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "A session token (fls_...) from "
                                                          "POST /api/v1/auth/login, or an API "
                                                          "key (flk_...)."}},
        },
    }


@blueprint.get(PREFIX + "/openapi.json")
async def openapi_json() -> dict[str, Any]:
    from fenceline.api.app import RESOURCES
    return document(RESOURCES)


# -- docs/API.md -------------------------------------------------------------------------

START = "<!-- endpoints:start (generated by python -m fenceline.api.openapi --write-docs) -->"
END = "<!-- endpoints:end -->"


def _fields(schema: Schema | None) -> str:
    if not schema or schema.get("type") != "object":
        return "none" if not schema else f"`{_kind(schema)}`"
    required = set(schema.get("required", []))
    parts = [f"`{name}`{'' if name in required else '?'}: {_kind(s)}"
             for name, s in schema.get("properties", {}).items()]
    return ", ".join(parts) or "`{}`"


def _kind(schema: Schema) -> str:
    kind = schema.get("type", "any")
    text = "|".join(kind) if isinstance(kind, list) else str(kind)
    if "format" in schema:
        text += f" ({schema['format']})"
    if "enum" in schema:
        text = "|".join(str(v) for v in schema["enum"] if v is not None)
    if kind == "array" and "items" in schema:
        text = f"[{_kind(schema['items'])}]"
    bounds = [f"{k} {schema[k]}" for k in ("minimum", "maximum", "minLength", "maxLength",
                                           "minItems", "maxItems") if k in schema
              and not (k == "minimum" and schema[k] == -2**31)
              and not (k == "maximum" and schema[k] == 2**31 - 1)]
    return text + (f" [{', '.join(bounds)}]" if bounds else "")


def markdown(resources: list[Resource]) -> str:
    lines = [START, ""]
    for resource in resources:
        lines += [f"### {resource.tag}", ""]
        for ep in resource.endpoints:
            lines.append(f"#### `{ep.method} {PREFIX}{ep.path}`")
            lines.append("")
            lines.append(ep.summary + ".")
            lines.append("")
            role = {None: "anonymous", "user": "any logged-in user"}.get(ep.role, ep.role)
            on = f" of the {ep.scope[0]}'s organization" if ep.scope else ""
            lines.append(f"- Role: {role}{on}" + ("; people only (no API keys)"
                                                  if ep.users_only else ""))
            if ep.query:
                lines.append("- Query: " + ", ".join(f"`{n}`: {_kind(s)}"
                                                      for n, s in ep.query.items()))
            if ep.body is not None:
                lines.append(f"- Body: {_fields(ep.body)}")
            for status, schema in sorted(ep.responses.items()):
                lines.append(f"- `{status}`: {_fields(schema) if schema else 'no body'}")
            lines.append("- Errors: " + ", ".join(f"`{s}`" for s in ep.all_problems))
            if ep.audit:
                lines.append(f"- Audit: `{ep.audit}`")
            lines.append("")
    lines.append(END)
    return "\n".join(lines)


def splice(text: str, generated: str) -> str:
    if START not in text or END not in text:
        return text.rstrip() + "\n\n## Endpoints\n\n" + generated + "\n"
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    return head + generated + tail


def main(argv: list[str] | None = None) -> None:
    from fenceline.api.app import RESOURCES
    parser = argparse.ArgumentParser(prog="python -m fenceline.api.openapi")
    parser.add_argument("--write-docs", metavar="API_MD", nargs="?", const="docs/API.md")
    args = parser.parse_args(argv)
    if args.write_docs:
        path = Path(args.write_docs)
        path.write_text(splice(path.read_text(), markdown(RESOURCES)))
        return
    json.dump(document(RESOURCES), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
