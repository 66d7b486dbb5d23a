"""The dashboard: templates and static files."""
