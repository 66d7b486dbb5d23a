"""The short report a chaos run prints: settings, faults, counts, figures, then each check."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from tests.chaos.checks import Check, Findings, median

if TYPE_CHECKING:
    from tests.chaos.run import ChaosConfig


def _kv(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def render(config: ChaosConfig, f: Findings, results: list[Check],
           timings: dict[str, float]) -> str:
    rerun = [r.rerun_s for r in f.recoveries]
    reaped = [r.reaped_s for r in f.recoveries]
    by_kind: dict[str, list[float]] = {}
    for r in f.recoveries:
        by_kind.setdefault(r.kind, []).append(r.rerun_s)
    fault_counts = Counter(x.event.kind for x in f.faults)
    lines = [
        f"chaos run, seed {config.seed}: {config.workers} workers x {config.concurrency}, "
        f"{config.schedulers} schedulers, lease {config.lease:g} s, reaper every "
        f"{config.reaper_interval:g} s, cap {config.cap}, {config.rate:g} jobs/s",
        "time: " + ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in timings.items()),
        f"faults: {_kv(dict(fault_counts))}",
    ]
    lines += [f"  {time.strftime('%H:%M:%S', time.localtime(x.event.at))} {x.event.kind:<13} "
              f"{x.summary}" for x in f.faults]
    lines += [
        f"jobs: {f.jobs_total} in the database ({f.acknowledged} acknowledged, "
        f"{f.unanswered} submits unanswered), {f.replayed} replays (max generation "
        f"{f.max_generation}); final: {_kv(f.by_status)}",
        f"  dead letters by reason: {_kv(f.dead_reasons)}",
        f"  attempts by outcome: {_kv(f.attempts_by_outcome)}",
        f"lost: {len(f.missing)}   stuck: {len(f.stuck)}   "
        f"two successes in one generation: {len(f.double_success)}   "
        f"fences run twice: {len(f.fence_ran_twice)}",
        f"fenced writes refused by the engine: {f.fenced_writes} ({_kv(f.violations)})",
        f"side effects: {f.runs} runs, {f.effects_accepted} accepted, {f.effects_rejected} "
        f"rejected as stale, {len(f.stale_accepted)} stale accepted; "
        f"{f.effect_at_two_fences} jobs committed work at two fences (at-least-once: the "
        "fence tells them apart)",
        f"in-flight: max {f.in_flight.max_leases} leases / {f.in_flight.max_running} running "
        f"of cap {f.cap} ({f.in_flight.samples} samples, {f.in_flight.missed} missed while "
        f"the server was down); breaker opened {f.breaker_opened} times",
        "cron: not yet built",
        f"recovery from a kill or stop: n={len(rerun)} jobs; back in the queue median "
        f"{median(reaped):.1f} s, max {max(reaped, default=float('nan')):.1f} s; running again "
        f"median {median(rerun):.1f} s, max {max(rerun, default=float('nan')):.1f} s"
        + "".join(f"; {k} median {median(v):.1f} max {max(v):.1f}"
                  for k, v in sorted(by_kind.items()))
        + (f"; {f.not_rerun} dead-lettered instead" if f.not_rerun else ""),
        f"reaper lateness (lease expiry, or the server back up -> reaped): "
        f"n={len(f.reap_lateness)}, median {median(f.reap_lateness):.1f} s, "
        f"max {max(f.reap_lateness, default=float('nan')):.1f} s",
        f"  {f.reaped_unstarted} attempts reaped before their handler started; "
        f"{f.own_write_refused} refusals of a report retried after it had committed",
        f"processes: {_kv(f.crashes)} 'service crashed' log lines (longest restart backoff "
        f"{f.max_restart_delay:g} s); final stop "
        f"{len(f.stop_codes)} processes, exit codes "
        f"{sorted({c for _, c in f.stop_codes}, key=str)}",
        "checks:",
    ]
    mark = {True: "PASS", False: "FAIL", None: "SKIP"}
    lines += [f"  {'WARN' if c.ok is False and c.known_issue else mark[c.ok]} {c.name}: "
              f"{c.detail}" + (f" (known issue: {c.known_issue})"
                               if c.ok is False and c.known_issue else "")
              for c in results]
    verdict = ("PASSED" if all(c.ok is not False or c.known_issue for c in results)
               else "FAILED")
    lines.append(f"chaos run {verdict}")
    return "\n".join(lines)
