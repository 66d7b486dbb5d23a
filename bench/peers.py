"""The peers: what to install for each, where its adapter is, and how to run it.

Each peer other than fenceline gets its own virtual environment under bench/.venvs/<peer>,
made with `python -m venv` and `pip install` of the pins below, and reused while the pins
(and the base interpreter) do not change. fenceline's adapter runs in the project's own
environment (the interpreter running the harness).

Adding a peer: write bench/adapters/<peer>_worker.py (see bench/adapters/_common.py for the
protocol) and add a PeerSpec here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ADAPTERS_DIR = BENCH_DIR / "adapters"
VENVS_DIR = BENCH_DIR / ".venvs"
EXIT_NOT_AVAILABLE = 3
STAMP = ".bench-requirements.json"


@dataclass(frozen=True)
class PeerSpec:
    name: str
    # Pinned requirements for the peer's own venv; None means "run in the project's venv".
    requirements: tuple[str, ...] | None
    note: str = ""

    @property
    def adapter(self) -> Path:
        return ADAPTERS_DIR / f"{self.name}_worker.py"


# Pins checked with `pip index versions <name>` on 2026-11-30: pgqueuer 1.6.0 and
# procrastinate 3.10.0 are the latest releases. pgqueuer[asyncpg] because its docs run the
# worker on one asyncpg connection; psycopg[binary] because procrastinate's connector needs
# psycopg 3 and the project itself uses the binary build. psutil in each, as a cross-check.
PEERS: dict[str, PeerSpec] = {
    spec.name: spec
    for spec in (
        PeerSpec(
            "pgqueuer",
            (
                "pgqueuer[asyncpg]==1.6.0",
                "asyncpg==0.32.0",
                "uvloop==0.23.0",
                "psutil==7.2.2",
            ),
        ),
        PeerSpec(
            "procrastinate",
            (
                "procrastinate==3.10.0",
                "psycopg[binary,pool]==3.3.9",
                "psycopg-pool==3.3.3",
                "psutil==7.2.2",
            ),
        ),
        PeerSpec("fenceline", None, note="runs in the project's venv"),
    )
}


class PeerUnavailable(Exception):
    """The peer cannot be measured here (venv not buildable, adapter exit code 3)."""


class AdapterFailed(Exception):
    """The adapter ran and failed: a broken script, not a missing peer."""


@dataclass
class Peer:
    spec: PeerSpec
    python: Path
    info: dict[str, Any] = field(default_factory=dict)
    freeze: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    def command(self, *args: str) -> list[str]:
        return [str(self.python), str(self.spec.adapter), *args]

    def run(self, *args: str, timeout: float = 600.0) -> dict[str, Any]:
        """Run one adapter command to completion; return its `result` JSON."""
        proc = subprocess.run(
            self.command(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=BENCH_DIR.parent,
            check=False,
        )
        if proc.returncode == EXIT_NOT_AVAILABLE:
            raise PeerUnavailable(_last_line(proc.stderr) or "adapter exit code 3")
        if proc.returncode != 0:
            raise AdapterFailed(
                f"{self.name} `{args[0]}` exited {proc.returncode}: "
                f"{_last_line(proc.stderr) or 'no stderr'}\n{_tail(proc.stderr)}"
            )
        return parse_result(proc.stdout)

    def spawn(self, *args: str, stderr_path: Path) -> AdapterProcess:
        return AdapterProcess(self, list(args), stderr_path)


class AdapterProcess:
    """A long-running adapter command (worker or producer) whose stdout is read line by line.

    A reader thread stamps each line with time.monotonic() when it arrives, so the harness
    can start its clock at the `ready` line without polling delay.
    """

    def __init__(self, peer: Peer, args: list[str], stderr_path: Path) -> None:
        self.peer = peer
        self.stderr_path = stderr_path
        self._stderr = stderr_path.open("w")
        self.proc = subprocess.Popen(
            peer.command(*args),
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
            cwd=BENCH_DIR.parent,
        )
        self.lines: Queue[tuple[float, str]] = Queue()
        self.all_lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            stamp = time.monotonic()
            line = line.rstrip("\n")
            self.all_lines.append(line)
            self.lines.put((stamp, line))

    def wait_line(self, prefix: str, timeout: float) -> tuple[float, str]:
        """Block until a stdout line starting with prefix; return (monotonic stamp, line)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AdapterFailed(f"{self.peer.name}: no '{prefix}' line in {timeout:.0f} s")
            try:
                stamp, line = self.lines.get(timeout=min(remaining, 0.2))
            except Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    self._check_exit(f"before printing '{prefix}'")
                continue
            if line.startswith(prefix):
                return stamp, line

    def _check_exit(self, when: str) -> None:
        rc = self.proc.returncode
        self._reader.join(timeout=2)
        if not self._stderr.closed:
            self._stderr.close()
        err = self.stderr_path.read_text(errors="replace")
        if rc == EXIT_NOT_AVAILABLE:
            raise PeerUnavailable(_last_line(err) or "adapter exit code 3")
        where = f" {when}" if when else ""
        raise AdapterFailed(
            f"{self.peer.name} adapter exited {rc}{where}: {_last_line(err) or 'no stderr'}"
            f" (log: {self.stderr_path})\n{_tail(err)}"
        )

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        """SIGTERM (graceful stop), wait, and return the `result` JSON."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float) -> dict[str, Any]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AdapterFailed(f"{self.peer.name}: did not exit within {timeout:.0f} s") from None
        self._reader.join(timeout=5)
        self._stderr.close()
        if self.proc.returncode != 0:
            self._check_exit("")
        return parse_result("\n".join(self.all_lines))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if not self._stderr.closed:
            self._stderr.close()


def parse_result(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("result "):
            parsed: dict[str, Any] = json.loads(line[len("result ") :])
            return parsed
    raise AdapterFailed(f"no 'result' line in adapter output:\n{_tail(stdout)}")


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _stamp_for(spec: PeerSpec) -> dict[str, Any]:
    return {
        "requirements": list(spec.requirements or ()),
        "base_python": sys.base_prefix,
        "python_version": sys.version.split()[0],
    }


def ensure_venv(spec: PeerSpec, log: Any = print, venvs_dir: Path = VENVS_DIR) -> Path:
    """Return the python of the peer's venv, creating or refreshing it when needed.

    Raises PeerUnavailable when the venv cannot be built (no network, no such version...).
    """
    if spec.requirements is None:
        return Path(sys.executable)
    venv = venvs_dir / spec.name
    python = _venv_python(venv)
    stamp_path = venv / STAMP
    wanted = _stamp_for(spec)
    if python.exists() and stamp_path.exists():
        try:
            if json.loads(stamp_path.read_text()) == wanted:
                return python
        except (OSError, ValueError):
            pass
    log(f"[{spec.name}] building venv {venv} ({', '.join(spec.requirements)})")
    if venv.exists():
        shutil.rmtree(venv)
    venvs_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "--quiet",
            *spec.requirements,
        ],
    ]
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    for step in steps:
        try:
            proc = subprocess.run(
                step, capture_output=True, text=True, timeout=900, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            shutil.rmtree(venv, ignore_errors=True)
            raise PeerUnavailable(f"venv step timed out: {' '.join(step[:4])}") from None
        if proc.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise PeerUnavailable(
                f"could not build its venv: {_last_line(proc.stderr) or 'no message'}"
                f"\n(step: {' '.join(step)})\n{_tail(proc.stderr, 8)}"
            )
    stamp_path.write_text(json.dumps(wanted))
    log(f"[{spec.name}] venv ready in {time.monotonic() - t0:.0f} s")
    return python


def pip_freeze(python: Path) -> list[str]:
    proc = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.stdout.split() if proc.returncode == 0 else []


def prepare(spec: PeerSpec, log: Any = print, venvs_dir: Path = VENVS_DIR) -> Peer:
    """Build or reuse the peer's venv and ask its adapter for its `info`.

    Raises PeerUnavailable (report and carry on) or AdapterFailed (a broken adapter).
    """
    if not spec.adapter.exists():
        raise PeerUnavailable(f"no adapter at {spec.adapter}")
    python = ensure_venv(spec, log, venvs_dir)
    peer = Peer(spec, python)
    peer.info = peer.run("info", timeout=120)
    if "remaining_sql" not in peer.info:
        raise AdapterFailed(f"{spec.name}: `info` gave no remaining_sql")
    if spec.requirements is not None:
        peer.freeze = pip_freeze(python)
    return peer
