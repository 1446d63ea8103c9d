"""The bare endpoint bench/http.py measures the service against: one FCALL, nothing else.

    REDIS_URL=... BENCH_BARE_CALL='{...}' .venv/bin/python -m bench.bare_app --port 8001

One route, `POST /v1/reservations`, runs the reserve script once through redis-py's asyncio
client (made by core.stores.redis.redis_client, as the service's is) with the keys and
arguments the service's own store built for the same call, recorded by bench/http.py and passed
in BENCH_BARE_CALL; only the reservation id is fresh per request. It reads no body, checks no
key, prices nothing and answers a small JSON. It is served the way `ceiling serve` serves the
app (uvicorn, one worker, start-up objects frozen out of the collector), so that the two differ
only in what the service does per request beyond its one FCALL.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from collections.abc import Mapping, Sequence

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from redis.asyncio.client import Redis

from api.cli import run_server
from bench.ledger import Call
from core.errors import ensure
from core.stores.redis import redis_client
from core.stores.scripts import script
from core.stores.wire import RESERVE_ARGS

CALL_ENV = "BENCH_BARE_CALL"


def call_to_json(call: Call) -> str:
    """What bench/http.py puts in CALL_ENV: the recorded words, with the id's places."""
    return json.dumps({
        "script": call.script.name,
        "sha1": call.script.sha1,
        "key_count": call.key_count,
        "words": list(call.words),
        "holes": [list(hole) for hole in call.holes],
    })


def call_from_env(env: Mapping[str, str]) -> Call:
    raw = json.loads(env[CALL_ENV])
    loaded = script(raw["script"])
    # The sha1 proves the script here is the one the store ran when the call was recorded.
    ensure(loaded.sha1 == raw["sha1"], "the bare app runs the script the store ran")
    return Call(
        loaded,
        int(raw["key_count"]),
        tuple(str(w) for w in raw["words"]),
        tuple((int(i), str(before), str(after)) for i, before, after in raw["holes"]),
    )


def create_app(call: Call, client: Redis) -> FastAPI:
    app = FastAPI(title="spend-ceiling bench: bare FCALL")
    reserved_micros = int(call.words[call.key_count + RESERVE_ARGS.index("reserved_micros")])

    @app.post("/v1/reservations", status_code=201)
    async def reserve() -> JSONResponse:
        reservation_id = uuid.uuid4().hex
        # The library's function, as the service's store calls it (core/stores/scripts.py).
        reply = await client.fcall(
            str(call.script.function), call.key_count, *call.words_for(reservation_id)
        )
        if reply[0] != "ok":
            # A refusal must not pass for a fast answer: the benchmark counts non-2xx as errors.
            return JSONResponse({"error": str(reply[0])}, status_code=500)
        # A new hold is of what was asked (core/stores/wire.py reservation).
        return JSONResponse(
            {"reservation_id": reservation_id, "reserved_micros": reserved_micros},
            status_code=201,
        )

    @app.get("/health/live")
    async def live() -> JSONResponse:
        return JSONResponse({"status": "live"})

    return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bare_app", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    options = p.parse_args(argv)
    # As `ceiling serve` serves, so that the two servers differ only in what runs per request.
    run_server(create_app(call_from_env(os.environ), redis_client(os.environ["REDIS_URL"])),
               options.host, options.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
