"""The HTTP API: a quart-trio app served by hypercorn's Trio worker."""
