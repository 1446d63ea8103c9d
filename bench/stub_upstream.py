"""The upstream behind every gateway bench/gateway.py measures: as cheap as a provider can be.

    ~/.cache/spend-ceiling/bench-venv/bin/python -m bench.stub_upstream --port 8900

Run with the benchmark's side venv (bench/side_venv.py), which has aiohttp and uvloop; the
project's own venv has neither, and this file imports nothing of the project's. Two routes,
`POST /v1/chat/completions` and Anthropic's `POST /v1/messages`, answer every call at once with
20 prompt and 20 completion tokens (the same bytes for every caller but the model's name), so the
gateways differ only in what they do themselves. `GET /billing` is its bill: the calls it
answered, by model, from which the benchmark checks each gateway's ledger; `GET /health/live`
answers 200 while it runs.

infra/stub_provider.py is the witness the tests use (real token counts, faults, streams); it
does far more per call than a benchmark's floor should, and a gateway measured behind it would
be measured against the stub's own CPU.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from aiohttp import web  # type: ignore[import-not-found, unused-ignore]

PROMPT_TOKENS = 20
COMPLETION_TOKENS = 20
ANSWER_TEXT = "The quick brown fox jumps over the lazy dog, and then it ran off to sleep again."


def answer(model: str) -> bytes:
    return json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER_TEXT},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS,
                  "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS},
    }, separators=(",", ":")).encode()


def message(model: str) -> bytes:
    """The same answer in Anthropic's Messages shape."""
    return json.dumps({
        "id": "msg_bench", "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": ANSWER_TEXT}], "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": COMPLETION_TOKENS},
    }, separators=(",", ":")).encode()


def create_app() -> Any:
    calls: Counter[str] = Counter()
    # Model names come from the gateways under test; a handful of them, answered from a cache.
    answers: dict[str, bytes] = {}
    messages: dict[str, bytes] = {}

    async def chat(request: Any) -> Any:
        body = json.loads(await request.read())
        model = str(body.get("model", ""))
        if body.get("stream"):
            return web.json_response({"error": {"message": "the bench stub does not stream",
                                                "type": "invalid_request_error"}}, status=400)
        calls[model] += 1
        if model not in answers:
            answers[model] = answer(model)
        return web.Response(body=answers[model], content_type="application/json")

    async def message_route(request: Any) -> Any:
        body = json.loads(await request.read())
        model = str(body.get("model", ""))
        if body.get("stream"):
            return web.json_response({"type": "error", "error": {
                "type": "invalid_request_error", "message": "the bench stub does not stream"}},
                status=400)
        calls[model] += 1
        if model not in messages:
            messages[model] = message(model)
        return web.Response(body=messages[model], content_type="application/json")

    async def billing(_: Any) -> Any:
        return web.json_response({"calls_by_model": dict(calls), "prompt_tokens": PROMPT_TOKENS,
                                  "completion_tokens": COMPLETION_TOKENS})

    async def live(_: Any) -> Any:
        return web.json_response({"status": "live"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/messages", message_route)
    app.router.add_get("/billing", billing)
    app.router.add_get("/health/live", live)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stub_upstream",
                                description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    options = p.parse_args(argv)
    try:
        import uvloop  # type: ignore[import-not-found, unused-ignore]

        uvloop.install()
    except ImportError:
        pass
    web.run_app(create_app(), host=options.host, port=options.port, access_log=None,
                print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
