"""The bare relay bench/gateway.py measures the gateway against: one more HTTP hop, nothing else.

    .venv/bin/python -m bench.relay_app --port 8002 --upstream http://127.0.0.1:8001/v1

Two routes, `POST /v1/chat/completions` and `POST /v1/messages`, send the body they received to
the provider's same path through
the gateway's own transport (api/transport.py: aiohttp's pool under httpx's API, prepared once
as api/upstream.py prepares it) and answers with the provider's status, content type and body.
No key check, no pricing, no ledger, no parsing. It is served as `ceiling serve` serves the app
(uvicorn, one worker, start-up objects frozen), so that the latency it adds over a direct call
is the floor under any gateway on this machine: what one more server and one more client in the
path cost before the ledger is touched.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import httpx
from fastapi import FastAPI, Request, Response

from api.cli import run_server
from api.transport import AiohttpTransport, Prepared

# As api/upstream.py's pool: enough connections for the benchmark's concurrent tasks.
CONNECTIONS_MAX = 256
TIMEOUT_S = 30.0


def create_app(upstream_url: str) -> FastAPI:
    app = FastAPI(title="spend-ceiling bench: bare relay")
    transport = AiohttpTransport(connections_max=CONNECTIONS_MAX)
    timeout = httpx.Timeout(TIMEOUT_S).as_dict()
    headers = [("content-type", "application/json")]
    chat = transport.prepare("POST", f"{upstream_url.rstrip('/')}/chat/completions", headers,
                             timeout)
    messages = transport.prepare("POST", f"{upstream_url.rstrip('/')}/messages", headers, timeout)

    async def relay(prepared: Prepared, request: Request) -> Response:
        answer = await transport.send(prepared, await request.body())
        try:
            body = await answer.aread()
        finally:
            await answer.aclose()
        return Response(body, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type"))

    @app.post("/v1/chat/completions")
    async def relay_chat(request: Request) -> Response:
        return await relay(chat, request)

    @app.post("/v1/messages")
    async def relay_messages(request: Request) -> Response:
        return await relay(messages, request)

    @app.get("/health/live")
    async def live() -> Response:
        return Response(b'{"status":"live"}', media_type="application/json")

    return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.relay_app",
                                description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the provider's base URL, ending in /v1")
    options = p.parse_args(argv)
    run_server(create_app(options.upstream), options.host, options.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
