"""The demo (`bash infra/demo.sh`): 25 instances against one ceiling, judged by the provider's bill.

1. 25 service instances, each with its own memory ledger (CEILING_SINGLE_REPLICA=1), 25 Locust
   workers (worker i -> instance i) calling until refused: 25 ceilings instead of one, and every
   instance's health says `degraded`.
2. The same 25 instances on one shared Redis ledger: the same scenario, then a larger budget
   spent to exhaustion, then Anthropic's Messages API through the gateway (25 workers in the
   anthropic SDK's wire format, every other call streamed), then Google's Gemini API through
   the gateway (generateContent with a thinking budget; the instances route both by
   CEILING_UPSTREAMS to named upstreams at the stub). The provider's bill stays within
   the ceiling and equals the ledger's committed spend to the micro-dollar. The instances
   deliver the alert events the runs produced to a receiver on loopback (each once, signed),
   and the spend page after the runs is saved (and screenshotted with chromium when it is
   installed).
3. The spend limits people ship, against the same stub provider, beside the enforced path
   (infra/baselines.py).

Exits non-zero when the shared ledger let the provider bill more than the ceiling, or a shared
run did not finish cleanly. Everything runs on 127.0.0.1 and is stopped by pid when it ends.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from core.money import micros_to_usd
from infra import baselines
from infra.alert_receiver import AlertReceiver
from infra.figures import table
from infra.fleet import (
    EXHAUSTION,
    GEMINI,
    HANDFUL,
    INSTANCES,
    MESSAGES,
    Fleet,
    LedgerMode,
    LoadResult,
)
from infra.stub_provider import StubProvider


@dataclass(frozen=True)
class FleetRun:
    """One fleet's start-up, health and load runs, as the summary reports them."""

    mode: LedgerMode
    start_s: float
    health: Counter[str]
    reasons: tuple[str, ...]
    results: tuple[LoadResult, ...]
    # Per run: what the instances' ledgers say was committed, one answer per instance.
    committed_micros: tuple[tuple[int, ...], ...]


def run_fleet(mode: LedgerMode, instances: int, seed: int, workloads: tuple[str, ...],
              receiver: AlertReceiver | None = None) -> FleetRun:
    print(f"\n== {instances} instances, {mode.value} ledger ==", flush=True)
    with Fleet(mode=mode, instances=instances, provider=StubProvider(seed=seed),
               alert_webhook_url=receiver.url if receiver else None,
               upstreams=GEMINI.user_class in workloads) as fleet:
        print(f"started {instances} instance processes in {fleet.start_s:.1f} s", flush=True)
        bodies = fleet.health()
        health = Counter(b["status"] for b in bodies)
        reasons = tuple(sorted({r for b in bodies for r in b["reasons"]}))
        print(f"health: {dict(health)}; reasons: {', '.join(reasons) or 'none'}", flush=True)
        results, committed = [], []
        for workload in (HANDFUL, EXHAUSTION, MESSAGES, GEMINI):
            if workload.user_class not in workloads:
                continue
            result = fleet.run_load(workload)
            results.append(result)
            committed.append(tuple(fleet.committed_micros(result.budget_id)))
            print(describe(result, committed[-1]), flush=True)
        if receiver is not None:
            show_alerts(fleet, receiver)
    return FleetRun(mode, fleet.start_s, health, reasons, tuple(results), tuple(committed))


# How long the demo waits for the instances' background delivery to go quiet.
ALERTS_QUIET_S = 3.0
ALERTS_WAIT_S_MAX = 30.0


def show_alerts(fleet: Fleet, receiver: AlertReceiver) -> None:
    """The alert events the runs produced, as the receiver got them (once each, signed), and the
    spend page after them (issue 16)."""
    deadline, seen, quiet_since = time.monotonic() + ALERTS_WAIT_S_MAX, -1, time.monotonic()
    while time.monotonic() < deadline:
        if len(receiver.posts) != seen:
            seen, quiet_since = len(receiver.posts), time.monotonic()
        elif time.monotonic() - quiet_since > ALERTS_QUIET_S:
            break
        time.sleep(0.2)
    accepted = [p for p in receiver.posts if p.status == 200]
    ids = Counter(str(p.json()["event_id"]) for p in accepted)
    signed = all(p.signed_by(fleet.alert_webhook_secret) for p in accepted)
    print(f"alerts: the receiver got {len(accepted)} events, {len(ids)} distinct "
          f"({sum(n - 1 for n in ids.values())} repeats), every one signed: {signed}", flush=True)
    for p in sorted(accepted, key=lambda p: p.json()["at_ms"]):
        e = p.json()
        what = f"{e['threshold_pct']}%" if e["threshold_pct"] else ""
        print(f"  {e['type']:<26} {e['budget_id']:<28} {e['period_key']:<16} {what:>5} "
              f"${micros_to_usd(e['committed_micros'])} of ${micros_to_usd(e['ceiling_micros'])}",
              flush=True)
    page = fleet.http.get(f"{fleet.urls[0]}/dashboard",
                          headers={"Authorization": f"Bearer {fleet.admin_token}"})
    saved = Path(tempfile.gettempdir()) / "spend-ceiling-dashboard.html"
    saved.write_text(page.text)
    shot = saved.with_suffix(".png")
    if shutil.which("chromium"):
        subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-background-networking", "--no-first-run",
                        f"--screenshot={shot}", "--window-size=1360,1400", saved.as_uri()],
                       capture_output=True, timeout=60, check=False)
    print(f"the spend page after the runs: {saved}" + (f" (screenshot {shot})"
                                                         if shot.exists() else ""), flush=True)


def describe(result: LoadResult, committed_micros: tuple[int, ...]) -> str:
    lines = [
        f"{result.user_class}: {result.workers} workers, {result.billed_calls} calls billed "
        f"${micros_to_usd(result.billed_micros)} against a ${micros_to_usd(result.ceiling_micros)}"
        f" ceiling: overrun {result.overrun_pct:.1f}% (locust exit {result.exit_code})",
    ]
    if len(set(committed_micros)) == 1:
        lines.append(f"  the shared ledger's committed spend: ${micros_to_usd(committed_micros[0])}"
                     f" (the provider's bill: ${micros_to_usd(result.billed_micros)})")
    else:
        lines.append(f"  each instance's own ledger says it committed at most "
                     f"${micros_to_usd(max(committed_micros))}: every one of them believes the "
                     f"ceiling held; together they committed "
                     f"${micros_to_usd(sum(committed_micros))}")
    if result.billed_at_first_refusal_micros is not None:
        lines.append(f"  spent when refusals began: "
                     f"${micros_to_usd(result.billed_at_first_refusal_micros)}; at the end "
                     f"{result.utilization_pct:.1f}% of the ceiling")
    return "\n".join(lines)


def summary(runs: list[FleetRun]) -> str:
    rows = []
    for run in runs:
        health = ", ".join(f"{n}/{sum(run.health.values())} {s}" for s, n in run.health.items())
        for result, committed in zip(run.results, run.committed_micros, strict=True):
            books = ("= bill" if set(committed) == {result.billed_micros}
                     else f"{len(set(committed))} ledgers, max ${micros_to_usd(max(committed))}")
            rows.append((
                f"{run.mode.value}: {result.user_class}", str(result.workers),
                micros_to_usd(result.ceiling_micros), str(result.billed_calls),
                micros_to_usd(result.billed_micros), f"{result.overrun_pct:.1f}%",
                f"{result.utilization_pct:.1f}%", books, health,
            ))
    return table(("ledger: scenario", "workers", "ceiling $", "calls", "billed $", "overrun",
                  "used", "ledger says", "health"), rows)


def held(run: FleetRun) -> bool:
    return all(r.exit_code == 0 and r.overrun_micros == 0 and set(c) == {r.billed_micros}
               for r, c in zip(run.results, run.committed_micros, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.demo",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=INSTANCES)
    parser.add_argument("--seed", type=int, default=7, help="the stub provider's seed")
    args = parser.parse_args(argv)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds the fleets, which stop what they started

    signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    memory = run_fleet(LedgerMode.MEMORY, args.instances, args.seed, (HANDFUL.user_class,))
    with AlertReceiver() as receiver:
        shared = run_fleet(LedgerMode.SHARED, args.instances, args.seed,
                           (HANDFUL.user_class, EXHAUSTION.user_class, MESSAGES.user_class,
                            GEMINI.user_class), receiver)
    print("\n== the spend limits people ship, against the same provider ==", flush=True)
    rows = baselines.run(args.seed)
    print(baselines.report(rows))
    print(f"\n== summary ({time.monotonic() - started:.0f} s) ==")
    print(summary([memory, shared]))
    ok = held(shared) and not any(r.enforced and r.billed_micros > r.ceiling_micros for r in rows)
    print("\nThe shared ledger held the ceiling: the provider billed no more than the ceiling, "
          "and the ledger's books equal the bill." if ok else
          "\nFAIL: the shared ledger let spend past the ceiling or a run did not finish.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
