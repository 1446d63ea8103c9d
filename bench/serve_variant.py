"""`ceiling serve`, with uvicorn's event loop and HTTP parser named, and probes for stalls.

    .venv/bin/python -m bench.serve_variant --loop uvloop --http httptools --port 8000
    .venv/bin/python -m bench.serve_variant --probes /tmp/probes.json --port 8000

What runs is `ceiling serve` itself (api.cli.main: its start-up check, gc.freeze(), its
keep-alive), with uvicorn.Config given `loop` and `http` when they are named: so a difference
measured against plain `ceiling serve` is theirs alone. uvloop and httptools must be installed
to be named (`.venv/bin/pip install uvloop httptools`); `auto` is what `ceiling serve` gets:
them when installed, asyncio and h11 when not.

With --probes FILE, the process measures where a slow call's time can go that a profiler does
not show, and writes it to FILE as JSON when it stops (SIGTERM: at the end of the app's
lifespan, in uvicorn's graceful shutdown):

  requests        each request's time inside the app, from the ASGI call to its last byte sent
                  (what the client sees less the wait before the app is called)
  gc              every collection's pause (gc.callbacks), by generation
  callbacks       every event-loop callback that ran longer than SLOW_CALLBACK_S (asyncio's
                  Handle._run; asyncio's loop only), less the collections inside it, named;
                  and how many callbacks ran in all (per request: how often a call queued)
  loop_lag        how late a 1 ms timer fires: the longest an event-loop iteration keeps a
                  ready callback waiting
  pools           the wait for a connection from the provider's pool (aiohttp's connector, or
                  httpcore's with --transport httpcore) and from redis-py's (the client's
                  commands; the scripts' connections are counted, their wait is not), and the
                  connections each made
  spawned         tasks the gateway starts behind an answer (core.gateway.spawn), and their time

The probes cost CPU of their own; a run with them measures the tail's causes, not throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

# A callback that holds the loop this long delays every other call's next step by as much.
SLOW_CALLBACK_S = 0.005
# Collections and waits at least this long are kept one by one, with when they happened.
KEPT_S = 0.001
LAG_TICK_S = 0.001
# The slowest requests kept with when they ran, to set beside the collections and callbacks.
SLOWEST_KEPT = 50


def now_s() -> float:
    return time.perf_counter()


@dataclass
class Durations:
    """Counted durations: all of them summed, the long ones kept with when they started."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    # The thread's CPU time in them, where it was taken: wall time far above it is time the
    # process waited for a core, not time it worked.
    cpu_total_s: float = 0.0
    long: list[tuple[float, float, str, float]] = field(default_factory=list)
    all_s: list[float] = field(default_factory=list)
    keep_all: bool = False

    def add(self, started_s: float, took_s: float, what: str = "", cpu_s: float = 0.0) -> None:
        self.count += 1
        self.total_s += took_s
        self.cpu_total_s += cpu_s
        self.max_s = max(self.max_s, took_s)
        if self.keep_all:
            self.all_s.append(took_s)
        if took_s >= KEPT_S:
            self.long.append((started_s, took_s, what, cpu_s))

    def json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"count": self.count, "total_s": self.total_s,
                                "cpu_total_s": self.cpu_total_s, "max_s": self.max_s,
                                "long": self.long}
        if self.keep_all:
            body["all_s"] = self.all_s
        return body


@dataclass
class Probes:
    started_s: float = field(default_factory=now_s)
    requests: Durations = field(default_factory=lambda: Durations(keep_all=True))
    gc_by_generation: dict[int, Durations] = field(
        default_factory=lambda: {g: Durations() for g in range(3)})
    callbacks: Durations = field(default_factory=Durations)
    lag: Durations = field(default_factory=lambda: Durations(keep_all=True))
    upstream_waits: Durations = field(default_factory=Durations)
    redis_waits: Durations = field(default_factory=Durations)
    spawned: Durations = field(default_factory=Durations)
    connections_made: dict[str, int] = field(default_factory=lambda: {"upstream": 0, "redis": 0})
    # When each new connection was made (probe time): a pool that churns connects mid-load.
    connected_at: dict[str, list[float]] = field(
        default_factory=lambda: {"upstream": [], "redis": []})
    # Callbacks the event loop ran: per request, how many times a call went back in the queue.
    handles_run: int = 0
    ticks: int = 0  # the lag ticker's own wake-ups, which are not the requests'
    gc_s: float = 0.0  # collection time so far, to take out of the callbacks it ran inside
    gc_cpu_s: float = 0.0
    _gc_started_s: float = 0.0
    _gc_cpu_started_s: float = 0.0

    def at(self, t: float) -> float:
        return t - self.started_s

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started_s, self._gc_cpu_started_s = now_s(), time.thread_time()
            return
        took_s = now_s() - self._gc_started_s
        cpu_s = time.thread_time() - self._gc_cpu_started_s
        self.gc_s += took_s
        self.gc_cpu_s += cpu_s
        self.gc_by_generation[info["generation"]].add(
            self.at(self._gc_started_s), took_s, f"collected {info['collected']}", cpu_s)

    def json(self) -> dict[str, Any]:
        return {
            "started_s": self.started_s,
            "elapsed_s": now_s() - self.started_s,
            "requests": self.requests.json(),
            "gc": {str(g): d.json() for g, d in self.gc_by_generation.items()},
            "gc_thresholds": gc.get_threshold(),
            "gc_frozen": gc.get_freeze_count(),
            "callbacks": self.callbacks.json(),
            "loop_lag": self.lag.json(),
            "upstream_waits": self.upstream_waits.json(),
            "redis_waits": self.redis_waits.json(),
            "spawned": self.spawned.json(),
            "connections_made": self.connections_made,
            "connected_at": self.connected_at,
            "handles_run": self.handles_run,
            "ticks": self.ticks,
            "census": census(),
        }


def timed_async(method: Callable[..., Awaitable[Any]], record: Durations, probes: Probes
                ) -> Callable[..., Awaitable[Any]]:
    async def timed(*args: Any, **kwargs: Any) -> Any:
        started_s = now_s()
        try:
            return await method(*args, **kwargs)
        finally:
            record.add(probes.at(started_s), now_s() - started_s)

    return timed


def install(probes: Probes) -> None:
    """Wrap what the probes time. Everything patched here is looked up at call time."""
    gc.callbacks.append(probes.on_gc)

    handle_run = asyncio.events.Handle._run

    def run(handle: asyncio.events.Handle) -> None:
        started_s, gc_before_s = now_s(), probes.gc_s
        cpu_started_s, gc_cpu_before_s = time.thread_time(), probes.gc_cpu_s
        probes.handles_run += 1
        handle_run(handle)
        took_s = now_s() - started_s - (probes.gc_s - gc_before_s)
        if took_s >= SLOW_CALLBACK_S:
            cpu_s = time.thread_time() - cpu_started_s - (probes.gc_cpu_s - gc_cpu_before_s)
            probes.callbacks.add(probes.at(started_s), took_s, repr(handle)[:300], cpu_s)

    asyncio.events.Handle._run = run  # type: ignore[method-assign, assignment]

    from aiohttp import connector

    base = connector.BaseConnector
    base._wait_for_available_connection = timed_async(  # type: ignore[method-assign, assignment]
        base._wait_for_available_connection, probes.upstream_waits, probes)
    tcp = connector.TCPConnector
    create_tcp = tcp._create_connection

    async def create_aiohttp(self: Any, *args: Any, **kwargs: Any) -> Any:
        probes.connections_made["upstream"] += 1
        probes.connected_at["upstream"].append(probes.at(now_s()))
        return await create_tcp(self, *args, **kwargs)

    tcp._create_connection = create_aiohttp  # type: ignore[method-assign]

    from httpcore._async import connection_pool

    pool_request = connection_pool.AsyncPoolRequest
    pool_request.wait_for_connection = timed_async(  # type: ignore[method-assign, assignment]
        pool_request.wait_for_connection, probes.upstream_waits, probes)
    pool = connection_pool.AsyncConnectionPool
    create_connection = pool.create_connection

    def create(self: Any, origin: Any) -> Any:
        probes.connections_made["upstream"] += 1
        probes.connected_at["upstream"].append(probes.at(now_s()))
        return create_connection(self, origin)

    pool.create_connection = create  # type: ignore[method-assign]

    from redis.asyncio import connection as redis_connection

    blocking = redis_connection.BlockingConnectionPool
    blocking.get_connection = timed_async(  # type: ignore[method-assign, assignment]
        blocking.get_connection, probes.redis_waits, probes)
    make_connection = redis_connection.ConnectionPool.make_connection

    def make(self: Any) -> Any:
        probes.connections_made["redis"] += 1
        probes.connected_at["redis"].append(probes.at(now_s()))
        return make_connection(self)  # type: ignore[no-untyped-call]

    redis_connection.ConnectionPool.make_connection = make  # type: ignore[method-assign]

    # The scripts' own connections (core/stores/redis_resp.py), made outside redis-py's pools.
    from core.stores.redis_resp import Endpoint

    endpoint_connect = Endpoint.connect

    async def connect(self: Any) -> Any:
        probes.connections_made["redis"] += 1
        probes.connected_at["redis"].append(probes.at(now_s()))
        return await endpoint_connect(self)

    Endpoint.connect = connect  # type: ignore[method-assign]

    from core import gateway

    spawn = gateway.spawn

    async def timed(work: Coroutine[Any, Any, None]) -> None:
        started_s = now_s()
        try:
            await work
        finally:
            probes.spawned.add(probes.at(started_s), now_s() - started_s)

    def spawned(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return spawn(timed(work))

    gateway.spawn = spawned


def timed_app(app: Any, probes: Probes) -> Any:
    async def timed(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started_s = now_s()
        try:
            await app(scope, receive, send)
        finally:
            probes.requests.add(probes.at(started_s), now_s() - started_s, scope["path"])

    return timed


def write(probes: Probes, path: str) -> None:
    """Written at shutdown, once no call is left to delay."""
    with open(path, "w") as out:
        json.dump(probes.json(), out)


def census(top: int = 15) -> dict[str, Any]:
    """What the collector walks on a full collection: every tracked object not frozen at
    start-up, by type, and the modules imported after the freeze (each brings its functions,
    classes and constants into the collector's generations)."""
    objects = gc.get_objects()
    by_type = Counter(type(o).__qualname__ for o in objects)
    modules = sorted(o.__name__ for o in objects if isinstance(o, types.ModuleType))
    return {"tracked_not_frozen": len(objects), "by_type": by_type.most_common(top),
            "modules": modules}


def probed_app(app: Any, probes: Probes, path: str) -> Any:
    """`app` with its requests timed, the lag ticker running while it is up, and what the
    probes measured written to `path` when its lifespan ends: uvicorn re-raises the SIGTERM it
    stopped on once it has shut down, so nothing after uvicorn.run would run."""
    timed = timed_app(app, probes)

    async def with_ticker(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await timed(scope, receive, send)
            return
        task = asyncio.get_running_loop().create_task(ticker(probes))
        try:
            await timed(scope, receive, send)
        finally:
            task.cancel()
            write(probes, path)

    return with_ticker


async def ticker(probes: Probes) -> None:
    while True:
        started_s = now_s()
        await asyncio.sleep(LAG_TICK_S)
        late_s = now_s() - started_s - LAG_TICK_S
        probes.ticks += 1
        probes.lag.add(probes.at(started_s), max(0.0, late_s))


class HttpcoreTransport:
    """The gateway's calls through httpx's own pool (httpcore), as they were sent before the
    aiohttp transport (api/transport.py): an httpx.Request per call, the same connection limit.
    Offers the two methods api/upstream.py uses."""

    def __init__(self, connections_max: int, proxy: str | None) -> None:
        import httpx

        self._pool = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=connections_max), proxy=proxy)

    def prepare(self, method: str, url: str, headers: list[tuple[str, str]],
                timeout: dict[str, float | None]) -> Any:
        import httpx

        return method, httpx.URL(url), headers, {"timeout": timeout}

    async def send(self, prepared: Any, content: bytes, headers: Any = (),
                   request: Any = None) -> Any:
        import httpx

        method, url, fixed, extensions = prepared
        return await self._pool.handle_async_request(httpx.Request(
            method, url, headers=[*fixed, *headers], content=content, extensions=extensions))

    async def aclose(self) -> None:
        await self._pool.aclose()


def use_httpcore_transport() -> None:
    """Send the gateway's calls through httpx's own pool (httpcore) instead of the gateway's
    aiohttp transport: what the gateway ran on before, for a measurement of what the transport
    changes. Upstream's own headers and timeouts are kept."""
    import httpx

    from api import upstream
    from core.formats import Api

    made = upstream.Upstream.__init__

    def init(self: upstream.Upstream, base_url: str, *args: Any, **kwargs: Any) -> None:
        made(self, base_url, *args, **kwargs)
        aiohttp_prepared = self._prepared
        self._transport = HttpcoreTransport(  # type: ignore[assignment]
            upstream.CONNECTIONS_MAX, upstream.environment_proxy(httpx.URL(base_url)))
        self._prepared = {
            api: self._transport.prepare(
                p.method, str(p.url), list(p.headers.items()),
                {"connect": p.timeout.sock_connect, "read": p.timeout.sock_read,
                 "write": p.timeout.sock_read,
                 "pool": (p.timeout.connect or 0) - (p.timeout.sock_connect or 0)})
            for api, p in aiohttp_prepared.items() if isinstance(api, Api)}

    upstream.Upstream.__init__ = init  # type: ignore[method-assign]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_variant",
                                description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    p.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto")
    p.add_argument("--probes", metavar="FILE", help="measure stalls; write them here on exit")
    p.add_argument("--transport", choices=("aiohttp", "httpcore"), default="aiohttp",
                   help="what sends the gateway's calls under httpx's API: the gateway's own "
                        "transport over aiohttp (what `ceiling serve` runs), or httpx's own "
                        "pool (httpcore), as before")
    options = p.parse_args(argv)

    import uvicorn

    probes = Probes() if options.probes else None
    config = uvicorn.Config

    def config_variant(app: Any, **kwargs: Any) -> uvicorn.Config:
        if probes is not None:
            app = probed_app(app, probes, options.probes)
        return config(app, **{**kwargs, "loop": options.loop, "http": options.http})

    uvicorn.Config = config_variant  # type: ignore[assignment, misc]
    if probes is not None:
        install(probes)
    if options.transport == "httpcore":
        use_httpcore_transport()
    from api.cli import main as ceiling

    return ceiling(["serve", "--host", options.host, "--port", str(options.port)])


if __name__ == "__main__":
    raise SystemExit(main())
