"""docs/API.md's endpoint reference is generated from the code and must be current."""

from __future__ import annotations

from pathlib import Path

from fenceline.api import openapi
from fenceline.api.app import RESOURCES

API_MD = Path(__file__).resolve().parents[2] / "docs" / "API.md"


def test_docs_api_md_is_fresh() -> None:
    text = API_MD.read_text()
    assert openapi.splice(text, openapi.markdown(RESOURCES)) == text, (
        "docs/API.md is stale: run python -m fenceline.api.openapi --write-docs")
