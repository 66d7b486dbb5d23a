"""Handlers that ship with fenceline, so the daemon is useful without writing Python.

| type  | payload                                              | result                      |
|-------|------------------------------------------------------|-----------------------------|
| noop  | anything                                             | null                        |
| sleep | {"ms": N}                                            | {"slept_ms": N}             |
| fail  | {"permanent": bool, "message": str}                  | always raises               |
| shell | {"command": "...", "timeout_s": N}                   | {"exit_code", "output"}     |
| http  | {"url": "...", "body": ..., "timeout_s": N}          | {"status": N}               |

A payload of the wrong shape is a permanent error: retrying cannot fix it.
"""

from __future__ import annotations

import math
import subprocess
from typing import Any

import httpx
import trio

from fenceline.worker.job import Job, PermanentError

MAX_SLEEP_MS = 24 * 3600 * 1000
MAX_OUTPUT_BYTES = 64 * 1024
DEFAULT_TIMEOUT_S = 60.0


def _number(payload: dict[str, Any], key: str, default: float | None, *, low: float,
            high: float) -> float:
    value = payload.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or not low <= value <= high):
        raise PermanentError(f"payload.{key} must be a number from {low:g} to {high:g}")
    return float(value)


def _object(job: Job) -> dict[str, Any]:
    if job.payload is None:
        return {}
    if not isinstance(job.payload, dict):
        raise PermanentError(f"{job.type} expects a JSON object payload")
    return job.payload


async def noop(job: Job) -> None:
    return None


async def sleep(job: Job) -> dict[str, Any]:
    ms = _number(_object(job), "ms", 0, low=0, high=MAX_SLEEP_MS)
    await trio.sleep(ms / 1000)
    return {"slept_ms": ms}


class FailHandlerError(Exception):
    """The error the built-in ``fail`` handler raises on purpose."""


async def fail(job: Job) -> None:
    payload = _object(job)
    message = str(payload.get("message", "failed on purpose"))
    if payload.get("permanent") is True:
        raise PermanentError(message)
    raise FailHandlerError(message)


async def shell(job: Job) -> dict[str, Any]:
    payload = _object(job)
    command = payload.get("command")
    if not isinstance(command, str) or not command.strip():
        raise PermanentError("payload.command must be a non-empty string")
    timeout = _number(payload, "timeout_s", DEFAULT_TIMEOUT_S, low=0.001, high=86400)
    with trio.fail_after(timeout):
        done = await trio.run_process(["/bin/sh", "-c", command], capture_stdout=True,
                                      stderr=subprocess.STDOUT, check=False)
    output = done.stdout[-MAX_OUTPUT_BYTES:].decode(errors="replace")
    job.log(f"exit code {done.returncode}")
    if done.returncode != 0:
        raise ShellCommandError(f"exit code {done.returncode}: {output[-2000:]}")
    return {"exit_code": done.returncode, "output": output}


class ShellCommandError(Exception):
    """A ``shell`` job's command exited non-zero (retried per the queue's policy)."""


class HttpStatusError(Exception):
    """An ``http`` job's endpoint answered with an error status (retried)."""


async def http(job: Job) -> dict[str, Any]:
    payload = _object(job)
    url = payload.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise PermanentError("payload.url must be an http:// or https:// URL")
    timeout = _number(payload, "timeout_s", DEFAULT_TIMEOUT_S, low=0.001, high=3600)
    headers = {"Idempotency-Key": f"fenceline-{job.id}-{job.fence}"}
    async with httpx.AsyncClient(timeout=timeout) as client:
        response = await client.post(url, json=payload.get("body"), headers=headers)
    job.log(f"POST {url} -> {response.status_code}")
    if response.status_code >= 500 or response.status_code == 429:
        raise HttpStatusError(f"POST {url} answered {response.status_code}")
    if response.status_code >= 400:
        raise PermanentError(f"POST {url} answered {response.status_code}")
    return {"status": response.status_code}


BUILTINS = {"noop": noop, "sleep": sleep, "fail": fail, "shell": shell, "http": http}
