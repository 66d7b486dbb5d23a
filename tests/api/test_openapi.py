"""The OpenAPI document and docs/API.md are generated from the code: valid, complete, fresh."""

from __future__ import annotations

import re

from openapi_spec_validator import validate

from fenceline.api import openapi
from fenceline.api.app import RESOURCES
from tests.api.conftest import Api


async def test_the_served_document_is_valid_openapi_3_1(api: Api) -> None:
    answer = await api.get("openapi.json")
    assert answer.status == 200
    assert answer.body["openapi"] == "3.1.0"
    validate(answer.body)


async def test_every_route_is_in_the_document(api: Api) -> None:
    doc = openapi.document(RESOURCES)
    served = set()
    for rule in api.app.url_map.iter_rules():
        if rule.endpoint == "static" or getattr(rule, "websocket", False):
            continue
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            served.add((method.lower(), path))
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert served == documented


def test_every_declared_endpoint_has_an_answer_and_errors() -> None:
    for resource in RESOURCES:
        for ep in resource.endpoints:
            assert ep.responses, ep.path
            assert all(200 <= s < 300 for s in ep.responses), ep.path
            if ep.role not in (None, "user"):
                assert ep.scope is not None or 403 in ep.problems, (
                    f"{ep.path}: a role without a scope must check it itself")
