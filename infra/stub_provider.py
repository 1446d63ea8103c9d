"""A stub OpenAI-compatible provider that keeps its own bill: the independent witness of spend.

The ceiling is proved against what a provider bills, never against what the service says it
spent. This stub counts the tokens of every call it serves itself and prices them with the same
bundled price table the service uses (core.prices.PriceTable, plus an optional overrides file
in the CEILING_PRICES_FILE format), so its bill is in real rates and shares nothing with the
ledger but the price list.

    python -m infra.stub_provider --port 8900 --seed 7

Routes:
  POST /v1/chat/completions   streaming (SSE `data: {...}` chunks, then `data: [DONE]`) and not.
                              Usage is in the response, and in a last chunk with `"choices": []`
                              when the request sets `stream_options.include_usage`. Only n = 1.
  GET  /billing               the bill: every call served, its tokens and cost in micro-dollars.
  POST /billing/reset         start a new bill.
  POST /control               faults for the next calls (below); `{}` clears them.
  GET  /health/live           200 while it answers.

What it serves: prompt tokens are the UTF-8 bytes of each message's content over four (OpenAI's
rule of thumb), plus 4 a message and 3 a reply, which never exceeds the service's byte-level
upper bound (core.estimate). The answer is `max_tokens` (or `max_completion_tokens`; 4,096 when
neither is sent) at most, drawn at random with mean `--output-tokens-mean`, after a random
latency in [`--latency-ms-min`, `--latency-ms-max`]. Draws come from one random.Random(seed):
a sequence of calls made one after another is reproducible; concurrent calls take the draws in
arrival order.

When a call is billed: in full, once its answer is ready, before the first byte is sent, whether
or not the client is still there to read it (a provider bills what it generated). A call that
fails or hangs on purpose, or that the stub rejects (bad request, unknown model, wrong key), is
not billed; every request is counted in `requests` all the same, so "nothing reached the
provider" is checkable.

Faults, for the gateway's tests:
  headers, for one call:  `X-Stub-Fail-Status: 503` answers that status (400-599) with an OpenAI
                          error body; `X-Stub-Hang: 1` never answers and holds the connection
                          until the client goes away (at most HANG_S_MAX); `X-Stub-Output-Tokens:
                          N` answers exactly min(N, max_tokens) tokens.
  POST /control:          `{"fail_status": 503}` or `{"hang": true}`, with `"calls": N` for the
                          next N calls only (all calls until cleared when absent). Use it when the
                          caller is a gateway that does not forward test headers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from core.errors import CeilingError
from core.money import micros_to_usd
from core.prices import PriceTable, Usage
from infra.redis_server import free_port

# OpenAI answers up to the model's output limit when no cap is sent; the stub stops here.
OUTPUT_TOKENS_UNCAPPED_MAX = 4_096
# A hung call is held this long at most, so a forgotten client cannot keep the stub busy forever.
HANG_S_MAX = 600.0
# Tokens per SSE chunk: enough chunks to exercise a client's stream parser, few enough to be cheap.
CHUNK_TOKENS = 16
BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
TOKENS_PER_REPLY = 3
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
# Idle keep-alive connections are kept this long (uvicorn's default is 5 s): a client reusing a
# pooled connection at the moment the server closes it gets a spurious read error.
KEEP_ALIVE_S = 120
# Calls still open at shutdown (a hung one) are cut after this long.
GRACEFUL_SHUTDOWN_S = 1
# The "model" answers with these words, one token each.
WORDS = ("the", "ceiling", "holds", "when", "every", "call", "reserves", "first", "and", "settles")


@dataclass
class Tally:
    """Calls served and what they cost, in one bill or one model's part of it."""

    calls: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    cost_micros: int = 0

    def add(self, usage: Usage, cost_micros: int) -> None:
        self.calls += 1
        self.input_tokens += usage.input_tokens
        self.cached_input_tokens += usage.cached_input_tokens
        self.output_tokens += usage.output_tokens
        self.cost_micros += cost_micros


@dataclass
class Bill:
    """What the provider charges: billed calls, and every chat request that arrived at all."""

    requests: int = 0
    total: Tally = field(default_factory=Tally)
    by_model: dict[str, Tally] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            **asdict(self.total),
            "cost_usd": micros_to_usd(self.total.cost_micros),
            "by_model": {m: asdict(t) for m, t in sorted(self.by_model.items())},
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Bill:
        def tally(d: dict[str, Any]) -> Tally:
            return Tally(**{f.name: int(d[f.name]) for f in fields(Tally)})

        return cls(
            int(doc["requests"]), tally(doc), {m: tally(t) for m, t in doc["by_model"].items()}
        )


@dataclass
class Fault:
    """What the next calls do instead of answering; `calls_left` None means until cleared."""

    fail_status: int | None = None
    hang: bool = False
    calls_left: int | None = None

    @property
    def active(self) -> bool:
        return (self.fail_status is not None or self.hang) and self.calls_left != 0


@dataclass(frozen=True)
class Served:
    """One answer, decided before the first byte: its usage, text and why it stopped."""

    completion_id: str
    model: str
    usage: Usage
    text: str
    finish_reason: str


class ProviderError(Exception):
    """An answer in OpenAI's error shape; nothing is billed for it."""

    def __init__(self, status: int, message: str, code: str, error_type: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.error_type = status, message, code, error_type

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.error_type, "param": None,
                          "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def invalid(message: str) -> ProviderError:
    return ProviderError(400, message, "invalid_request", "invalid_request_error")


def prompt_tokens(messages: object) -> int:
    """The stub's own count; never above core.estimate's byte-level bound for the same messages."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list")
    tokens = TOKENS_PER_REPLY
    for message in messages:
        if not isinstance(message, dict):
            raise invalid("each message must be an object")
        content = message.get("content", "")
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        tokens += TOKENS_PER_MESSAGE + math.ceil(len(text.encode()) / BYTES_PER_TOKEN)
    return tokens


def output_cap(body: dict[str, Any]) -> int:
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    if cap is None:
        return OUTPUT_TOKENS_UNCAPPED_MAX
    if type(cap) is not int or cap < 1:
        raise invalid("max_tokens must be a positive integer")
    return cap


class StubProviderApp:
    """The provider's state (price table, random draws, bill, faults) and its routes."""

    def __init__(
        self,
        *,
        seed: int,
        latency_ms_min: int,
        latency_ms_max: int,
        output_tokens_mean: int,
        prices: PriceTable,
        api_key: str | None = None,
    ) -> None:
        if not 0 <= latency_ms_min <= latency_ms_max or output_tokens_mean < 1:
            raise ValueError("need 0 <= latency_ms_min <= latency_ms_max and a positive mean")
        self.rng = random.Random(seed)
        self.latency_ms_min, self.latency_ms_max = latency_ms_min, latency_ms_max
        self.output_tokens_mean = output_tokens_mean
        self.prices = prices
        self.api_key = api_key
        self.bill = Bill()
        self.fault = Fault()
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/billing", self.get_billing, methods=["GET"]),
            Route("/billing/reset", self.reset_billing, methods=["POST"]),
            Route("/control", self.control, methods=["GET", "POST"]),
            Route("/health/live", self.live, methods=["GET"]),
        ])

    # -- routes ------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        self.bill.requests += 1
        try:
            fail_status, hang = self._fault_for(request)
            if hang:
                await self._hang(request)
                return Response(status_code=504)  # nobody reads it: the client has gone
            if fail_status is not None:
                raise ProviderError(fail_status, f"stub failure {fail_status} on request",
                                    "stub_failure", "server_error")
            body = await self._body(request)
            served = self._serve(body, request.headers.get("x-stub-output-tokens"))
        except ProviderError as exc:
            return exc.response()
        await asyncio.sleep(self.rng.uniform(self.latency_ms_min, self.latency_ms_max) / 1000)
        self._charge(served)
        if body.get("stream") is True:
            options = body.get("stream_options") or {}
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            return StreamingResponse(
                self._chunks(served, include_usage), media_type="text/event-stream"
            )
        return JSONResponse({
            "id": served.completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": served.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": served.text},
                         "finish_reason": served.finish_reason}],
            "usage": usage_json(served.usage),
        })

    async def get_billing(self, request: Request) -> Response:
        return JSONResponse(self.bill.to_json())

    async def reset_billing(self, request: Request) -> Response:
        self.bill = Bill()
        return JSONResponse(self.bill.to_json())

    async def control(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                doc = await request.json()
                self.fault = _fault_from_json(doc)
            except (ValueError, TypeError) as exc:
                return invalid(f"control body: {exc}").response()
        return JSONResponse({"fail_status": self.fault.fail_status, "hang": self.fault.hang,
                             "calls": self.fault.calls_left})

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    # -- one call ----------------------------------------------------------------------------

    def _fault_for(self, request: Request) -> tuple[int | None, bool]:
        header_status = request.headers.get("x-stub-fail-status")
        if header_status is not None:
            try:
                return _fail_status(header_status), False
            except ValueError as exc:
                raise invalid(f"X-Stub-Fail-Status: {exc}") from exc
        if request.headers.get("x-stub-hang") == "1":
            return None, True
        if self.fault.active:
            if self.fault.calls_left is not None:
                self.fault.calls_left -= 1
            return self.fault.fail_status, self.fault.hang
        return None, False

    async def _hang(self, request: Request) -> None:
        # Reading ASGI messages drains the body, then blocks until the client disconnects.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HANG_S_MAX):
                while (await request.receive())["type"] != "http.disconnect":
                    pass

    async def _body(self, request: Request) -> dict[str, Any]:
        if self.api_key is not None and request.headers.get("authorization") != (
            f"Bearer {self.api_key}"
        ):
            raise ProviderError(401, "incorrect API key", "invalid_api_key",
                                "invalid_request_error")
        try:
            body = await request.json()
        except ClientDisconnect as exc:  # gone before it finished sending: nothing to serve
            raise ProviderError(499, "the client went away", "client_disconnected",
                                "invalid_request_error") from exc
        except ValueError as exc:
            raise invalid("the body is not JSON") from exc
        if not isinstance(body, dict):
            raise invalid("the body must be a JSON object")
        return body

    def _serve(self, body: dict[str, Any], forced_output_tokens: str | None) -> Served:
        model = body.get("model")
        if not isinstance(model, str):
            raise invalid("model is required")
        if body.get("n", 1) != 1:
            raise invalid("the stub answers n = 1 only")
        input_tokens = prompt_tokens(body.get("messages"))
        cap = output_cap(body)
        try:
            self.prices.rates(model)
        except CeilingError as exc:  # an unpriced model cannot be billed, so it is not served
            raise ProviderError(404, f"the model {model!r} does not exist", "model_not_found",
                                "invalid_request_error") from exc
        if forced_output_tokens is not None:
            if not forced_output_tokens.isdigit() or int(forced_output_tokens) < 1:
                raise invalid("X-Stub-Output-Tokens must be a positive integer")
            drawn = int(forced_output_tokens)
        else:
            drawn = 1 + int(self.rng.expovariate(1 / self.output_tokens_mean))
        output_tokens = min(cap, drawn)
        return Served(
            completion_id="chatcmpl-" + secrets.token_hex(12),
            model=model,
            usage=Usage(input_tokens, output_tokens),
            text=" ".join(WORDS[i % len(WORDS)] for i in range(output_tokens)),
            finish_reason="length" if output_tokens == cap else "stop",
        )

    def _charge(self, served: Served) -> None:
        cost_micros = self.prices.cost_micros(served.model, served.usage)
        self.bill.total.add(served.usage, cost_micros)
        self.bill.by_model.setdefault(served.model, Tally()).add(served.usage, cost_micros)

    async def _chunks(self, served: Served, include_usage: bool) -> AsyncIterator[bytes]:
        words = served.text.split(" ")
        head = {"id": served.completion_id, "object": "chat.completion.chunk",
                "created": int(time.time()), "model": served.model}
        yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]})
        for start in range(0, len(words), CHUNK_TOKENS):
            piece = " ".join(words[start:start + CHUNK_TOKENS])
            text = piece if start == 0 else " " + piece
            yield sse({**head, "choices": [{"index": 0, "delta": {"content": text},
                                            "finish_reason": None}]})
        yield sse({**head, "choices": [{"index": 0, "delta": {},
                                        "finish_reason": served.finish_reason}]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage_json(served.usage)})
        yield b"data: [DONE]\n\n"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_input_tokens},
    }


def sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def _fail_status(raw: object) -> int:
    status = int(raw) if isinstance(raw, str) and raw.isdigit() else raw
    if type(status) is not int or not 400 <= status <= 599:
        raise ValueError("fail_status must be an HTTP error status, 400 to 599")
    return status


def _fault_from_json(doc: object) -> Fault:
    if not isinstance(doc, dict) or set(doc) - {"fail_status", "hang", "calls"}:
        raise ValueError("expected an object with fail_status, hang and calls")
    fail_status = None if doc.get("fail_status") is None else _fail_status(doc["fail_status"])
    hang = doc.get("hang", False)
    calls = doc.get("calls")
    if type(hang) is not bool or (calls is not None and (type(calls) is not int or calls < 1)):
        raise ValueError("hang is a boolean and calls a positive integer")
    if fail_status is not None and hang:
        raise ValueError("give fail_status or hang, not both")
    return Fault(fail_status, hang, calls)


# -- running it ------------------------------------------------------------------------------


@dataclass
class StubProvider:
    """The stub on a free loopback port, served by uvicorn on a thread of this process.

    A thread, not a process: the harness that starts it is otherwise idle while calls run, and
    stopping it needs no pid. `python -m infra.stub_provider` runs the same app as a process.
    """

    seed: int = 0
    latency_ms_min: int = 20
    latency_ms_max: int = 200
    output_tokens_mean: int = 250
    prices_file: str | None = None
    api_key: str | None = None
    port: int = field(default_factory=free_port)
    _server: uvicorn.Server | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StubProvider:
        app = StubProviderApp(
            seed=self.seed, latency_ms_min=self.latency_ms_min,
            latency_ms_max=self.latency_ms_max, output_tokens_mean=self.output_tokens_mean,
            prices=PriceTable.from_file(self.prices_file), api_key=self.api_key,
        )
        self._server = uvicorn.Server(server_config(app, self.port))
        self._thread = threading.Thread(target=self._server.run, name="stub-provider",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stub provider did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(STOP_TIMEOUT_S)
        self._server = self._thread = None

    def __enter__(self) -> StubProvider:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def server_config(app: StubProviderApp, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app.app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
        lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def fetch_bill(provider_url: str) -> Bill:
    response = httpx.get(f"{provider_url}/billing", timeout=5.0)
    response.raise_for_status()
    return Bill.from_json(response.json())


def reset_bill(provider_url: str) -> None:
    httpx.post(f"{provider_url}/billing/reset", timeout=5.0).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-ms-min", type=int, default=StubProvider.latency_ms_min)
    parser.add_argument("--latency-ms-max", type=int, default=StubProvider.latency_ms_max)
    parser.add_argument("--output-tokens-mean", type=int, default=StubProvider.output_tokens_mean)
    parser.add_argument("--prices-file", help="price overrides, in CEILING_PRICES_FILE's format")
    parser.add_argument("--api-key", help="refuse calls without this bearer key (401)")
    args = parser.parse_args()
    app = StubProviderApp(
        seed=args.seed, latency_ms_min=args.latency_ms_min, latency_ms_max=args.latency_ms_max,
        output_tokens_mean=args.output_tokens_mean,
        prices=PriceTable.from_file(args.prices_file), api_key=args.api_key,
    )
    uvicorn.Server(server_config(app, args.port)).run()


if __name__ == "__main__":
    main()
