"""Redis CPU and bytes per gateway call: our reserve + settle beside hardcap 0.1.0's admit + settle.

    .venv/bin/python -m bench.ledger_cpu            # about 30 s; --help for cycles and rounds

Each side gets a redis-server of its own (no persistence), started here and stopped by pid, and
runs the same number of reserve + settle cycles in concurrent asyncio tasks:

  ours     RedisStore.reserve then .settle, as the gateway makes them: one budget with a total
           limit, the gateway's owner, a random reservation id (no Idempotency-Key).
  hardcap  hardcap's own admit.lua and settle.lua (read from its wheel, fetched with pip) through
           redis-py's Script, with the arguments its BudgetLedger builds for a tenant with a
           total budget and no rate limit, as bench/gateway.py configures it.

Rounds alternate A,B,B,A so a drift in the machine's load falls on both. Printed per cycle: the
server's CPU (INFO cpu, user + system: parsing, scripts, replies), the scripts' own time (INFO
commandstats: EVALSHA and FCALL), the commands a cycle runs inside its scripts, and the bytes the
server still holds per cycle once the cycles are done (INFO memory) and, with --wait-s, after a
gateway call's record has gone (RESEND_WINDOW_MS). Time is the lead's measure on an idle
machine; on a busy one the instructions a server runs per gateway call are the steadier figure:
bench/instructions.py counts them (callgrind) for the calls a real gateway call makes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.ledger import GATEWAY_OWNER_PREFIX, ReservationRef, ReserveRequest
from core.limits import RESEND_WINDOW_MS, RESERVATION_TTL_MS_DEFAULT
from core.stores.redis import RedisStore
from infra.redis_server import RedisServer

HARDCAP = "hardcap==0.1.0"
# Enough cycles that a round's CPU is tens of milliseconds above the server's idle ticks.
CYCLES = 5_000
ROUNDS = 4
TASKS = 16
# A small chat call, as bench/gateway.py sends: its worst case held, settled at 20 + 20 tokens.
HELD_MICROS = 8_300
ACTUAL_MICROS = 60
EST_IN_TOKENS, EST_OUT_TOKENS, ACTUAL_TOKENS = 30, 4_096, 20
HARDCAP_TOTAL_TOKENS = 10**15
HARDCAP_WINDOW_S = 86_400
HARDCAP_RESERVATION_TTL_MS = 120_000


@dataclass(frozen=True)
class Round:
    side: str
    cycles: int
    server_cpu_s: float
    script_usec: float
    script_calls: int
    commands: int

    def per_cycle_us(self) -> float:
        return self.server_cpu_s / self.cycles * 1e6


async def server_counters(client: aioredis.Redis) -> tuple[float, float, int, int]:
    """Server CPU (s), script time (us), script calls, and commands run by scripts."""
    cpu = await client.info("cpu")
    stats = await client.info("commandstats")
    usec = calls = commands = 0
    for name, row in stats.items():
        if name in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall"):
            usec += row["usec"]
            calls += row["calls"]
        elif not name.startswith(("cmdstat_info", "cmdstat_config", "cmdstat_script",
                                  "cmdstat_function")):
            commands += row["calls"]
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), usec, calls, commands


async def run_round(side: str, client: aioredis.Redis, cycle: Callable[[], Awaitable[None]],
                    cycles: int, tasks: int) -> Round:
    await client.config_resetstat()
    before = await server_counters(client)
    left = iter(range(cycles))

    async def worker() -> None:
        for _ in left:
            await cycle()

    await asyncio.gather(*(worker() for _ in range(tasks)))
    after = await server_counters(client)
    # The two INFO calls after the reset are the measurement's own; they are not counted.
    return Round(side, cycles, after[0] - before[0], after[1] - before[1], after[2] - before[2],
                 after[3] - before[3])


def hardcap_scripts() -> tuple[str, str]:
    """admit.lua and settle.lua from hardcap's wheel, fetched by pip into a temporary folder."""
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--disable-pip-version-check", "-d", folder, HARDCAP],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wheel = next(Path(folder).glob("hardcap-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            return (z.read("hardcap/lua/admit.lua").decode(),
                    z.read("hardcap/lua/settle.lua").decode())


async def ours(url: str) -> tuple[Callable[[], Awaitable[None]], RedisStore]:
    store = RedisStore(url)
    tag = f"org:bench{uuid.uuid4().hex[:8]}"
    budget = BudgetId(tag)
    await store.put_budget(BudgetDef(budget, (Limit(Period.TOTAL, 10**15),)))
    owner = GATEWAY_OWNER_PREFIX + "key_" + uuid.uuid4().hex[:16]

    async def cycle() -> None:
        ref = ReservationRef(tag, f"{uuid.uuid4().hex[:16]}_{uuid.uuid4().hex}", owner)
        # As core/service.py makes a gateway call's: kept only for resends once resolved.
        await store.reserve(ReserveRequest(
            ref, budget.lineage, HELD_MICROS, RESERVATION_TTL_MS_DEFAULT, "",
            "genai-prices-0.2.3", "bench-model", retention_ms=RESEND_WINDOW_MS))
        await store.settle(ref, ACTUAL_MICROS)

    return cycle, store


def hardcap(client: aioredis.Redis, admit_source: str, settle_source: str
            ) -> Callable[[], Awaitable[None]]:
    admit, settle = client.register_script(admit_source), client.register_script(settle_source)
    tenant = f"t{uuid.uuid4().hex[:8]}"
    key_ttl_s = HARDCAP_WINDOW_S * 2 + HARDCAP_RESERVATION_TTL_MS // 1000 + 60

    async def cycle() -> None:
        # As hardcap's BudgetLedger builds them: window by the tenant's window length.
        window = int(time.time() // HARDCAP_WINDOW_S)
        base = f"hardcap:{{{tenant}}}"
        keys = [f"{base}:rl", f"{base}:b:{window}", f"{base}:rz:{window}", f"{base}:rv:{window}"]
        rid = uuid.uuid4().hex
        admitted = await admit(keys=keys, args=[
            "reserve", rid, EST_IN_TOKENS, EST_OUT_TOKENS, EST_OUT_TOKENS, 0, 0,
            HARDCAP_TOTAL_TOKENS, HARDCAP_RESERVATION_TTL_MS, key_ttl_s, "none", 0, 1000, 0])
        assert int(admitted[0]) == 1, admitted
        await settle(keys=keys[1:], args=[rid, ACTUAL_TOKENS, ACTUAL_TOKENS, key_ttl_s])

    return cycle


async def used_memory(client: aioredis.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def main(options: argparse.Namespace) -> None:
    admit_source, settle_source = hardcap_scripts()
    with RedisServer() as ours_redis, RedisServer() as hardcap_redis:
        clients = {"ours": aioredis.Redis.from_url(ours_redis.url),
                   "hardcap": aioredis.Redis.from_url(hardcap_redis.url)}
        our_cycle, store = await ours(ours_redis.url)
        cycles = {"ours": our_cycle,
                  "hardcap": hardcap(clients["hardcap"], admit_source, settle_source)}
        for side in cycles:  # warm-up: scripts loaded, pools filled, first keys made
            await run_round(side, clients[side], cycles[side], options.cycles // 10, options.tasks)
        memory_before = {side: await used_memory(c) for side, c in clients.items()}
        rounds: list[Round] = []
        for i in range(options.rounds):
            order = ("ours", "hardcap") if i % 2 == 0 else ("hardcap", "ours")
            for side in order:
                rounds.append(await run_round(side, clients[side], cycles[side], options.cycles,
                                              options.tasks))
        total = options.rounds * options.cycles
        kept = {side: (await used_memory(c) - memory_before[side]) / total
                for side, c in clients.items()}
        print(f"{options.rounds} rounds of {options.cycles} reserve+settle cycles each side, "
              f"{options.tasks} tasks; medians over rounds (and the least: other processes only "
              "ever add to a round's CPU)")
        print(f"{'':8} {'server CPU us/cycle':>20} {'least':>7} {'script us/cycle':>16} "
              f"{'commands/cycle':>15} {'bytes kept/cycle':>17}")
        summary, least = {}, {}
        for side in cycles:
            mine = [r for r in rounds if r.side == side]
            cpu = statistics.median(r.per_cycle_us() for r in mine)
            least[side] = min(r.per_cycle_us() for r in mine)
            script = statistics.median(r.script_usec / r.cycles for r in mine)
            commands = statistics.median(r.commands / r.cycles for r in mine)
            summary[side] = cpu
            print(f"{side:8} {cpu:20.1f} {least[side]:7.1f} {script:16.1f} {commands:15.1f} "
                  f"{kept[side]:17.0f}")
        print(f"ours / hardcap server CPU per cycle: {summary['ours'] / summary['hardcap']:.2f} "
              f"(least: {least['ours'] / least['hardcap']:.2f})")
        if options.wait_s:
            await asyncio.sleep(options.wait_s)
            after = (await used_memory(clients["ours"]) - memory_before["ours"]) / total
            print(f"ours: bytes kept per cycle {options.wait_s:.0f} s later: {after:.0f}")
        await store.close()
        for c in clients.values():
            await c.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=CYCLES)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--tasks", type=int, default=TASKS)
    parser.add_argument("--wait-s", type=float, default=0.0,
                        help="then wait this long and print the bytes still kept")
    asyncio.run(main(parser.parse_args()))
