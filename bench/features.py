"""What end users, rates and per-model limits cost the ledger when a budget uses them, against
the same call without them, in the same run.

    .venv/bin/python -m bench.features      # about 1 min; --help for rounds and durations

One redis-server (started here on a free loopback port, stopped by pid) and RedisStore's
reserve then settle in 50 asyncio tasks, as bench/ledger.py's store loop runs them, on the same
path of 3 scopes (4 legs). Every call names its model by its one name, as the gateway's do.
The shapes of the key's budget, interleaved over rounds:

  plain     the path as it is: no end user, no rate, no models (what every call costs with none
            of them used)
  users     the key's budget has per_user limits (day and total), and each call names one of
            USERS end users: 2 more legs, the users set read
  rate      the key's budget has a rate (requests_per_minute and concurrent_max): its call log
            and its open-call count
  both      per_user with its own rate, and the budget's rate: all of the above
  per_model the key's budget allows a list of models and limits the call's (day and total):
            the definition's models read, 2 more legs
  wait      plain, with CEILING_REDIS_WAIT_REPLICAS=1: every reserve acknowledged by the
            primary's one replica (a second redis-server) before it returns (Redis WAIT)

Printed per shape: cycles/s, this process' CPU per cycle, and Redis' CPU per cycle (from
INFO's used_cpu_user + sys: the figure the scripts move, least moved by this process); the
cost of each shape is its Redis CPU per cycle over plain's, the median of the rounds' ratios.
No target: the figures go to docs/measured.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

import redis

from bench.common import Cycle, Phase, run_phase
from bench.ledger import ACTUAL_MICROS, LIMITS_BY_SCOPE, MODEL, reserve_request
from core.budgets import BudgetDef, BudgetId, Limit, ModelLimits, Period, PerUser, Rate
from core.limits import CEILING_MICROS_MAX, REQUESTS_PER_MINUTE_MAX
from core.stores.redis import RedisStore
from infra.figures import median, table
from infra.redis_server import RedisServer

TASKS = 50
ROUNDS = 5
PHASE_S = 2.0
WARMUP_S = 1.0
# End users the calls of the users shapes are spread over: each user's rate stays far from its
# limit, so no call of the benchmark is refused.
USERS = 100
PER_USER_LIMITS = (Limit(Period.DAY, CEILING_MICROS_MAX), Limit(Period.TOTAL, CEILING_MICROS_MAX))
# The most a rate may allow: a shape's calls over all its rounds stay below it.
RATE = Rate(requests_per_minute=REQUESTS_PER_MINUTE_MAX, concurrent_max=TASKS * 2)
# The per_model shape's models: the call's, limited day and total, in an allow-list of as many
# models as a budget may limit (the list a reserve searches is that long).
MODELS_ALLOWED = (MODEL, *(f"model-{i}" for i in range(31)))
PER_MODEL = (ModelLimits(MODEL, (Limit(Period.DAY, CEILING_MICROS_MAX),
                                 Limit(Period.TOTAL, CEILING_MICROS_MAX))),)
# shape -> (rate, per_user, (models_allow, per_model) or None)
SHAPES: dict[str, tuple[Rate | None, PerUser | None,
                        tuple[tuple[str, ...], tuple[ModelLimits, ...]] | None]] = {
    "plain": (None, None, None),
    "users": (None, PerUser(PER_USER_LIMITS, users_max=USERS), None),
    "rate": (RATE, None, None),
    "both": (RATE, PerUser(PER_USER_LIMITS, users_max=USERS, rate=RATE), None),
    "per_model": (None, None, (MODELS_ALLOWED, PER_MODEL)),
    "wait": (None, None, None),
}
# The shapes whose reserves wait for a replica, and how long they may.
WAITING = frozenset({"wait"})
WAIT_TIMEOUT_MS = 1_000
# A replica on loopback connects and syncs an empty primary in well under this.
REPLICA_SYNC_S_MAX = 10.0


async def redis_cpu_s(store: RedisStore) -> float:
    info = await store.transport.execute("INFO", "cpu")
    text = info if isinstance(info, str) else "\n".join(f"{k}:{v}" for k, v in info.items())
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


async def put_shape(store: RedisStore, shape: str) -> tuple[BudgetId, ...]:
    """The path of `shape`: its own organisation, so the shapes share no counter."""
    rate, per_user, models = SHAPES[shape]
    lineage = BudgetId.parse(f"org:{shape}/team:search/key:k1").lineage
    for budget_id, limits in zip(lineage, LIMITS_BY_SCOPE, strict=True):
        last = budget_id == lineage[-1]
        allow, per_model = models if models and last else (None, ())
        await store.put_budget(BudgetDef(budget_id, limits, rate=rate if last else None,
                                         per_user=per_user if last else None,
                                         models_allow=allow, per_model=per_model))
    return lineage


def cycle_of(store: RedisStore, shape: str, budget_ids: tuple[BudgetId, ...]) -> Cycle:
    users = itertools.cycle(f"user-{i}@example.com" for i in range(USERS))
    named = SHAPES[shape][1] is not None

    async def cycle() -> float:
        request = replace(reserve_request(budget_ids[0].tag, budget_ids),
                          user=next(users) if named else None, canonical_model=MODEL)
        await store.reserve(request)
        await store.settle(request.ref, ACTUAL_MICROS)
        return 0.0

    return cycle


async def measure(server: RedisServer, options: argparse.Namespace
                  ) -> dict[str, list[tuple[Phase, float]]]:
    store = RedisStore(server.url)
    waiting = RedisStore(server.url, wait_replicas=1, wait_timeout_ms=WAIT_TIMEOUT_MS)
    try:
        cycles = {shape: cycle_of(waiting if shape in WAITING else store, shape,
                                  await put_shape(store, shape))
                  for shape in SHAPES}
        for cycle in cycles.values():
            await run_phase(cycle, options.tasks, options.warmup_seconds)
        found: dict[str, list[tuple[Phase, float]]] = {shape: [] for shape in SHAPES}
        order = list(SHAPES)
        for r in range(options.rounds):
            for shape in order[r % len(order):] + order[:r % len(order)]:
                before = await redis_cpu_s(store)
                phase = await run_phase(cycles[shape], options.tasks, options.seconds)
                found[shape].append((phase, await redis_cpu_s(store) - before))
        return found
    finally:
        await store.close()
        await waiting.close()


def report(found: dict[str, list[tuple[Phase, float]]]) -> str:
    per_cycle = {shape: [cpu / phase.cycles * 1e6 for phase, cpu in runs]
                 for shape, runs in found.items()}
    rows = []
    for shape, runs in found.items():
        ratios = [mine / plain for mine, plain in zip(per_cycle[shape], per_cycle["plain"],
                                                      strict=True)]
        rows.append([shape, f"{median([p.cycles_per_s for p, _ in runs]):,.0f}",
                     f"{median([p.cpu_us_per_cycle for p, _ in runs]):.1f}",
                     f"{median(per_cycle[shape]):.1f}", f"{median(ratios):.3f}",
                     f"{min(ratios):.3f}-{max(ratios):.3f}"])
    return ("reserve+settle through RedisStore, 50 tasks; Redis CPU (the primary's) from INFO, "
            "per cycle\n\n"
            + table(["shape", "cycles/s", "client CPU us/cycle", "Redis CPU us/cycle",
                     "x plain (median)", "rounds"], rows))


def wait_synced(replica: RedisServer) -> None:
    """Until the replica's link to its primary is up (the wait shape's WAIT counts it)."""
    deadline_s = time.monotonic() + REPLICA_SYNC_S_MAX
    client = redis.Redis(port=replica.port, decode_responses=True)
    while client.info("replication").get("master_link_status") != "up":
        if time.monotonic() > deadline_s:
            raise RuntimeError("the replica did not connect to its primary")
        time.sleep(0.05)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=TASKS)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--seconds", type=float, default=PHASE_S)
    p.add_argument("--warmup-seconds", type=float, default=WARMUP_S)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    with RedisServer(durable=True) as server, \
            RedisServer(durable=True, replica_of=server.port) as replica:  # AOF everysec
        wait_synced(replica)
        print(report(asyncio.run(measure(server, options))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
