"""Numbered SQL migrations, shipped in the wheel as fenceline.migrations (see pyproject)."""
