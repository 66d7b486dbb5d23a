"""Password hashing with argon2id, off the event loop.

A hash at the standard cost takes tens of milliseconds of CPU and 64 MiB of memory, which
would stall every other request if run inline, so it runs in a worker thread behind a small
limiter (at most ``MAX_PARALLEL`` at once: memory stays bounded under a login storm).

Login takes the same time whether or not the email is known: an unknown email is verified
against a dummy hash made with the same parameters (reference W24). Hashes made with older
parameters are upgraded on the next successful login.
"""

from __future__ import annotations

import trio
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

# RFC 9106's second recommended option (argon2id, t=3, 64 MiB, p=4), argon2-cffi's default.
STANDARD = "standard"
# The cheapest parameters argon2 accepts: for tests only, never for real passwords.
MINIMAL = "minimal"
PROFILES = (STANDARD, MINIMAL)

MAX_PARALLEL = 2


def _hasher(profile: str) -> PasswordHasher:
    if profile == MINIMAL:
        return PasswordHasher(time_cost=1, memory_cost=8, parallelism=1, hash_len=16, salt_len=8)
    return PasswordHasher()


class Passwords:
    def __init__(self, profile: str = STANDARD) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown password profile {profile!r}")
        self._hasher = _hasher(profile)
        self._limiter = trio.CapacityLimiter(MAX_PARALLEL)
        self._dummy: str | None = None

    async def hash(self, password: str) -> str:
        return await trio.to_thread.run_sync(self._hasher.hash, password, limiter=self._limiter)

    async def verify(self, stored: str | None, password: str) -> tuple[bool, str | None]:
        """(matches, new hash to store or None). ``stored`` None = unknown user."""
        if stored is None:
            if self._dummy is None:
                self._dummy = await self.hash("fenceline dummy password")
            await trio.to_thread.run_sync(self._check, self._dummy, password,
                                          limiter=self._limiter)
            return False, None
        ok = await trio.to_thread.run_sync(self._check, stored, password, limiter=self._limiter)
        if ok and self._hasher.check_needs_rehash(stored):
            return True, await self.hash(password)
        return ok, None

    def _check(self, stored: str, password: str) -> bool:
        try:
            return self._hasher.verify(stored, password)
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            return False
