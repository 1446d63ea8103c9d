"""What each client behind the upstream boundary (api/transport.py) costs per call.

    .venv/bin/python -m bench.transport            # ~1 min; --calls N --rounds R

One process sends a chat call to bench/stub_upstream.py (the benchmark's cheapest provider), one
call at a time on one keep-alive connection, through `upstream_transport` with each
UpstreamClient in turn, in interleaved rounds, and reads each answer to its end as the gateway
does. Printed: this process's CPU (user and system, /proc's account of it) per call, each
client's best round, and httpx's against aiohttp's. Only the client differs between the rounds:
the same prepared request, the same body, the same stub. On a shared machine the figures move
with what else runs; the ratio moves less, since the rounds are interleaved.

This is what decides whether the aiohttp bypass still pays: CEILING_UPSTREAM_CLIENT's default
is the cheaper one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Coroutine, Sequence
from typing import TypeVar

import httpx

from api.transport import UpstreamClient, UpstreamTransport, upstream_transport
from bench import side_venv
from bench.gateway import Server, chat_body
from infra.figures import table

CALLS = 2_000
ROUNDS = 3
WARMUP_CALLS = 100
TIMEOUT = httpx.Timeout(10.0).as_dict()
T = TypeVar("T")
HEADERS = (("content-type", "application/json"), ("authorization", "Bearer sk-bench"))


async def cpu_us_per_call(transport: UpstreamTransport[object], url: str, calls: int) -> float:
    prepared = transport.prepare("POST", f"{url}/v1/chat/completions", HEADERS, TIMEOUT)
    body = chat_body("bench-transport").encode()

    async def one() -> None:
        response = await transport.send(prepared, body)
        await response.aread()
        await response.aclose()

    for _ in range(WARMUP_CALLS):
        await one()
    started_s = time.process_time()
    for _ in range(calls):
        await one()
    return (time.process_time() - started_s) / calls * 1e6


async def measure(url: str, calls: int, rounds: int) -> dict[UpstreamClient, list[float]]:
    transports = {c: upstream_transport(connections_max=1, client=c) for c in UpstreamClient}
    found: dict[UpstreamClient, list[float]] = {c: [] for c in UpstreamClient}
    try:
        for _ in range(rounds):
            for client, transport in transports.items():
                found[client].append(await cpu_us_per_call(transport, url, calls))
    finally:
        for transport in transports.values():
            await transport.aclose()
    return found


def event_loop_run(main: Coroutine[None, None, T]) -> T:
    """`main` on the event loop `ceiling serve` runs on: uvloop's when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=CALLS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    options = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        stub = stack.enter_context(Server("bench stub", [side_venv.python(), "-m",
                                                         "bench.stub_upstream"]))
        found = event_loop_run(measure(stub.url, options.calls, options.rounds))
    best = {client: min(rounds) for client, rounds in found.items()}
    print(table(["client", "CPU us per call, best round", "rounds"],
                [[client.value, f"{best[client]:.1f}",
                  ", ".join(f"{r:.1f}" for r in found[client])] for client in UpstreamClient]))
    print(f"httpx / aiohttp: {best[UpstreamClient.HTTPX] / best[UpstreamClient.AIOHTTP]:.2f}x "
          f"(load average {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
