"""The soak harness: a steady rate of calls through a fleet for a bounded time. Does anything grow?

Run by `python -m bench.soak` (its entry point) and, briefly, by tests/reliability/test_soak.py.
A fleet (infra.fleet: INSTANCES `ceiling serve` processes, a durable Redis) and the stub provider
in a process of its own, all on 127.0.0.1, started here and stopped by pid. Calls arrive at a
fixed rate, open loop (a slow answer does not slow the arrivals; past IN_FLIGHT_MAX open calls
an arrival is skipped and counted), round-robin over the instances; each one is reserve ->
provider -> settle through the sidecar API. Every sample it reads each instance's resident
memory (VmRSS in /proc/<pid>/status), Redis's used memory and the budget's open reservations;
per bucket (a minute by default) it reports the p99 of the reserve and of the whole call.

Verdicts, printed under the table:
- memory flat: every instance's RSS at the end of the last bucket is within RSS_GROWTH_MAX of
  its RSS at the end of the second (the first bucket is warm-up: imports, pools, caches);
- p99 stable: the median bucket p99 of the later half of the run is within P99_DRIFT_MAX of the
  earlier half's (warm-up excluded): drift, not one noisy minute on a shared machine;
- open reservations bounded: never more than the calls in flight can hold, none at the end;
- books: the ledger's committed equals the provider's bill.

Redis's memory grows by design: resolved reservations are kept as long as a repeat can need them
(core/limits.py: a sidecar call's for the idempotency window, a gateway call's for seconds), so
it is reported, with its bytes per call, not judged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from core.budgets import BudgetId
from core.money import micros_to_usd
from core.stores import keys
from core.stores.redis import RedisStore
from infra.figures import median, percentile, table
from infra.fleet import Fleet
from infra.processes import tls_context
from infra.stub_provider import StubProviderProcess, fetch_bill

DURATION_S = 600.0
RATE_PER_S = 40.0
INSTANCES = 4
BUCKET_S = 60.0
SAMPLE_S = 5.0
# Open calls the load generator holds at most; a call lasts about the provider's latency, so at
# RATE_PER_S this is only reached when the fleet stops keeping up, and then arrivals are
# skipped, not queued.
IN_FLIGHT_MAX = 200
RSS_GROWTH_MAX = 0.10
P99_DRIFT_MAX = 2.0
MODEL = "gpt-4o-mini"
OUTPUT_TOKENS_MAX = 500
PROVIDER_LATENCY_MS = (20, 200)
# A soak must never be refused for money: $1,000 is ~6 million calls of this model and size.
CEILING_MICROS = 1_000_000_000
# A request on a loaded 2-core machine can queue for seconds behind its instance's other work;
# past this the instance is taken to be dead (the crash tests count it as "no answer").
REQUEST_TIMEOUT_S = 30.0
# Idle connections close before uvicorn's own 5 s keep-alive does: a request sent on a
# connection the server is closing fails, and would count as an error of the service.
KEEPALIVE_S = 2.0
# Calls still open when the arrivals stop get this long to finish.
DRAIN_S_MAX = 60.0


def http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT_S, verify=tls_context(),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None,
                            keepalive_expiry=KEEPALIVE_S),
    )


def rss_kib(pid: int) -> int:
    """Resident memory of one process, from the kernel's own account."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = DURATION_S
    rate_per_s: float = RATE_PER_S
    instances: int = INSTANCES
    bucket_s: float = BUCKET_S
    sample_s: float = SAMPLE_S
    in_flight_max: int = IN_FLIGHT_MAX

    @property
    def buckets(self) -> int:
        return max(1, math.ceil(self.duration_s / self.bucket_s))


@dataclass(frozen=True)
class CallTiming:
    started_s: float  # since the run began
    reserve_s: float
    call_s: float
    error: str | None


@dataclass(frozen=True)
class Sample:
    at_s: float
    rss_kib: tuple[int, ...]  # one per instance, in fleet order
    redis_used_kib: int
    open_reservations: int
    in_flight: int


@dataclass(frozen=True)
class Bucket:
    index: int
    calls: int
    errors: int
    reserve_p99_s: float
    call_p99_s: float
    open_max: int
    rss_kib: tuple[int, ...]  # at the bucket's last sample
    redis_used_kib: int


@dataclass(frozen=True)
class SoakResult:
    config: SoakConfig
    buckets: tuple[Bucket, ...]
    calls: int
    errors: int
    skipped: int
    error_kinds: dict[str, int]
    open_max: int
    open_at_end: int
    committed_micros: int
    billed_micros: int
    billed_calls: int

    @property
    def rss_growth(self) -> tuple[float, ...]:
        """Per instance: RSS at the end of the last bucket over the second's, minus one."""
        if len(self.buckets) < 2:
            return ()
        second, last = self.buckets[1].rss_kib, self.buckets[-1].rss_kib
        return tuple(b / a - 1 for a, b in zip(second, last, strict=True))

    @property
    def memory_flat(self) -> bool:
        return bool(self.rss_growth) and max(self.rss_growth) <= RSS_GROWTH_MAX

    @property
    def p99_drift(self) -> float:
        """Median bucket p99 of the later half over the earlier half's (warm-up excluded)."""
        p99s = [b.call_p99_s for b in self.buckets[1:] if b.calls]
        if len(p99s) < 2:
            return math.nan
        half = len(p99s) // 2
        return median(p99s[-half:]) / median(p99s[:half])

    @property
    def p99_stable(self) -> bool:
        return self.p99_drift <= P99_DRIFT_MAX

    @property
    def open_bounded(self) -> bool:
        return self.open_max <= self.config.in_flight_max and self.open_at_end == 0

    @property
    def redis_bytes_per_call(self) -> float:
        if len(self.buckets) < 2 or not self.calls:
            return math.nan
        grown_kib = self.buckets[-1].redis_used_kib - self.buckets[0].redis_used_kib
        calls_between = sum(b.calls for b in self.buckets[1:])
        return grown_kib * 1024 / calls_between if calls_between else math.nan


@dataclass
class LoadGenerator:
    """Open-loop arrivals over the fleet, and the samples taken while they run."""

    fleet: Fleet
    api_key: str
    tag: str
    config: SoakConfig
    timings: list[CallTiming] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    skipped: int = 0
    in_flight: int = 0

    async def run(self) -> None:
        # One client per instance and one for the provider: httpx's pool scans its connections
        # on every request, which costs more the larger one pool grows.
        clients = [http_client() for _ in self.fleet.urls]
        provider = http_client()
        raw = aioredis.Redis.from_url(self.fleet.redis.url, decode_responses=True)
        auth = {"Authorization": f"Bearer {self.api_key}"}
        started_s = time.monotonic()
        arrivals_done = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()

        async def one_call(number: int) -> None:
            instance = number % len(clients)
            client, url = clients[instance], self.fleet.urls[instance]
            began_s = time.monotonic()
            reserve_s = math.nan
            error = None
            messages = [{"role": "user", "content": f"soak call {number}: summarise this."}]
            try:
                r = await client.post(f"{url}/v1/reservations", headers=auth, json={
                    "model": MODEL, "messages": messages, "max_output_tokens": OUTPUT_TOKENS_MAX})
                reserve_s = time.monotonic() - began_s
                if r.status_code != 201:
                    error = f"reserve {r.status_code}"
                else:
                    rid = r.json()["reservation_id"]
                    answer = await provider.post(
                        f"{self.fleet.provider.url}/v1/chat/completions",
                        json={"model": MODEL, "messages": messages,
                              "max_tokens": OUTPUT_TOKENS_MAX})
                    usage = answer.json()["usage"]
                    s = await client.post(f"{url}/v1/reservations/{rid}/settle", headers=auth,
                                          json={"input_tokens": usage["prompt_tokens"],
                                                "output_tokens": usage["completion_tokens"]})
                    if s.status_code != 200:
                        error = f"settle {s.status_code}"
            except httpx.HTTPError as exc:
                error = type(exc).__name__
            finally:
                self.in_flight -= 1
            self.timings.append(CallTiming(began_s - started_s, reserve_s,
                                           time.monotonic() - began_s, error))

        async def sample() -> None:
            pids = [s.process.pid for s in self.fleet.services if s.process is not None]
            info = await raw.info("memory")
            self.samples.append(Sample(
                time.monotonic() - started_s, tuple(rss_kib(p) for p in pids),
                int(info["used_memory"]) // 1024, int(await raw.zcard(keys.open_leases(self.tag))),
                self.in_flight,
            ))

        async def sampler() -> None:
            while not arrivals_done.is_set():
                await sample()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrivals_done.wait(), self.config.sample_s)

        sampling = asyncio.create_task(sampler())
        try:
            interval_s = 1 / self.config.rate_per_s
            for number in itertools.count():
                due_s = started_s + number * interval_s
                if due_s - started_s >= self.config.duration_s:
                    break
                await asyncio.sleep(max(0.0, due_s - time.monotonic()))
                if self.in_flight >= self.config.in_flight_max:
                    self.skipped += 1
                    continue
                self.in_flight += 1
                task = asyncio.create_task(one_call(number))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            # A last sample at the end of the arrivals closes the last bucket.
            await sample()
            arrivals_done.set()
            await sampling
            if tasks:
                await asyncio.wait(tasks, timeout=DRAIN_S_MAX)
            await sample()  # after the drain: what is still open now is held by nobody
        finally:
            arrivals_done.set()
            for task in (*tasks, sampling):
                task.cancel()
            for client in (*clients, provider):
                await client.aclose()
            await raw.aclose()


def buckets_of(config: SoakConfig, timings: list[CallTiming],
               samples: list[Sample]) -> tuple[Bucket, ...]:
    out = []
    for i in range(config.buckets):
        lo, hi = i * config.bucket_s, (i + 1) * config.bucket_s
        calls = [t for t in timings if lo <= t.started_s < hi]
        ok = [t for t in calls if t.error is None]
        # The samples taken inside the bucket; the last one taken by its end closes it.
        inside = [s for s in samples if lo <= s.at_s <= hi] or [
            max((s for s in samples if s.at_s <= hi), key=lambda s: s.at_s)]
        out.append(Bucket(
            i, len(calls), len(calls) - len(ok),
            percentile([t.reserve_s for t in ok], 99), percentile([t.call_s for t in ok], 99),
            max(s.open_reservations for s in inside), inside[-1].rss_kib,
            inside[-1].redis_used_kib,
        ))
    return tuple(out)


async def ledger_committed(redis_url: str, budget_id: str) -> int:
    store = RedisStore(redis_url)
    try:
        (leg,) = await store.status((BudgetId.parse(budget_id),))
    finally:
        await store.close()
    return leg.committed_micros


def provision(fleet: Fleet, budget_id: str) -> str:
    auth = {"Authorization": f"Bearer {fleet.admin_token}"}
    r = fleet.http.put(f"{fleet.urls[0]}/v1/admin/budgets/{budget_id}", headers=auth, json={
        "limits": [{"period": "total", "ceiling_micros": CEILING_MICROS}]})
    r.raise_for_status()
    r = fleet.http.post(f"{fleet.urls[0]}/v1/admin/keys", headers=auth,
                        json={"budget_id": budget_id, "roles": ["sidecar"]})
    r.raise_for_status()
    return str(r.json()["api_key"])


def run(config: SoakConfig) -> SoakResult:
    provider = StubProviderProcess(seed=3, latency_ms_min=PROVIDER_LATENCY_MS[0],
                                   latency_ms_max=PROVIDER_LATENCY_MS[1])
    budget_id = f"org:soak-{secrets.token_hex(4)}"
    with Fleet(instances=config.instances, provider=provider) as fleet:
        api_key = provision(fleet, budget_id)
        load = LoadGenerator(fleet, api_key, BudgetId.parse(budget_id).tag, config)
        asyncio.run(load.run())
        bill = fetch_bill(fleet.provider.url)
        committed = asyncio.run(ledger_committed(fleet.redis.url, budget_id))
    errors: dict[str, int] = {}
    for t in load.timings:
        if t.error is not None:
            errors[t.error] = errors.get(t.error, 0) + 1
    return SoakResult(
        config, buckets_of(config, load.timings, load.samples[:-1]), len(load.timings),
        sum(errors.values()), load.skipped, errors,
        max(s.open_reservations for s in load.samples), load.samples[-1].open_reservations,
        committed, bill.total.cost_micros, bill.total.calls,
    )


def report(result: SoakResult) -> str:
    c = result.config
    header = ["bucket", "calls", "errors", "reserve p99 ms", "call p99 ms", "open max",
              "redis MiB", *(f"rss i{i} MiB" for i in range(c.instances))]
    rows = [
        [f"{b.index * c.bucket_s:.0f}-{(b.index + 1) * c.bucket_s:.0f} s", str(b.calls),
         str(b.errors), f"{b.reserve_p99_s * 1000:.1f}", f"{b.call_p99_s * 1000:.1f}",
         str(b.open_max), f"{b.redis_used_kib / 1024:.1f}",
         *(f"{kib / 1024:.1f}" for kib in b.rss_kib)]
        for b in result.buckets
    ]
    growth = ", ".join(f"{g * 100:+.1f}%" for g in result.rss_growth)
    books = "equal" if result.committed_micros == result.billed_micros else "DIFFERENT"

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    return "\n".join([
        f"soak: {c.rate_per_s:g} calls/s for {c.duration_s:g} s through {c.instances} "
        f"instances; {result.calls} calls, {result.errors} errors"
        f"{f' {result.error_kinds}' if result.error_kinds else ''}, "
        f"{result.skipped} arrivals skipped (over {c.in_flight_max} in flight)",
        "",
        table(header, rows),
        "",
        f"memory flat (last bucket within {RSS_GROWTH_MAX:.0%} of the second, per instance): "
        f"{growth or 'n/a'} -> {verdict(result.memory_flat)}",
        f"p99 stable (later half / earlier half of the bucket p99s, at most "
        f"{P99_DRIFT_MAX:g}x): {result.p99_drift:.2f}x -> {verdict(result.p99_stable)}",
        f"open reservations bounded (at most {c.in_flight_max}, none at the end): max "
        f"{result.open_max}, at the end {result.open_at_end} -> "
        f"{verdict(result.open_bounded)}",
        f"books: the ledger committed ${micros_to_usd(result.committed_micros)}, the provider "
        f"billed ${micros_to_usd(result.billed_micros)} for {result.billed_calls} calls: {books}",
        f"redis used memory grows ~{result.redis_bytes_per_call:.0f} bytes a call (resolved "
        "reservations are kept a week, by design)",
    ])
