"""Trio-native PostgreSQL: driver, pool, listener, migrator, embedded server."""
