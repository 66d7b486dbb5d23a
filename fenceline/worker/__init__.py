"""The worker runtime and built-in handlers."""
