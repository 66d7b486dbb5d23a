"""Who is calling: bearer tokens for sessions (people) and API keys (programs).

A token is ``fls_`` (session) or ``flk_`` (API key) followed by 32 random bytes in base64url.
Only its SHA-256 is stored. Expiry and revocation are read from the row on every request,
with ``fl.now()``, so logout and key revocation take effect on the next request.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import uuid
from dataclasses import dataclass

from fenceline.api.problems import Problem

SESSION_PREFIX = "fls_"
KEY_PREFIX = "flk_"
SESSION_DAYS = 30


def new_token(prefix: str) -> tuple[str, bytes]:
    """A fresh token and the hash to store."""
    token = prefix + base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    return token, token_hash(token)


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class Caller:
    """An authenticated principal: a user (through a session) or an API key."""

    user_id: uuid.UUID | None = None
    session_id: uuid.UUID | None = None
    key_id: uuid.UUID | None = None
    key_project: uuid.UUID | None = None
    key_role: str | None = None

    @property
    def is_user(self) -> bool:
        return self.user_id is not None


def unauthenticated(detail: str = "a valid bearer token is required") -> Problem:
    return Problem(401, "unauthenticated", "Unauthenticated", detail,
                   headers={"WWW-Authenticate": 'Bearer realm="fenceline"'})


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


# The caller behind a token as one row (user_id, session_id, key_id, key_project, key_role),
# over %(token)s (the token's SHA-256). fenceline.api.authz.authorise puts it into the one
# statement that also finds the caller's role, so there is one lookup for every request.
SESSION_CALLER = (
    "select user_id, id, null::uuid, null::uuid, null::text from fl.sessions"
    " where token_hash = %(token)s and revoked_at is null and expires_at > fl.now()")
KEY_CALLER = (
    "select null::uuid, null::uuid, id, project_id, role::text from fl.api_keys"
    " where token_hash = %(token)s and revoked_at is null"
    "   and (expires_at is null or expires_at > fl.now())")


def caller_query(token: str | None) -> str | None:
    """`SESSION_CALLER` or `KEY_CALLER` by the token's prefix; None: no such token can exist."""
    if token is None:
        return None
    if token.startswith(SESSION_PREFIX):
        return SESSION_CALLER
    if token.startswith(KEY_PREFIX):
        return KEY_CALLER
    return None
