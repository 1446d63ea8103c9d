"""A stub OpenAI-compatible and Anthropic provider that keeps its own bill: the witness of spend.

The ceiling is proved against what a provider bills, never against what the service says it
spent. This stub counts the tokens of every call it serves and prices them from its own table
(infra/stub_prices.py), sharing nothing with the service it judges: no `core`, no genai-prices.
It sees every way a gateway could hold less than a provider charges: images, audio and files,
prompt-cache reads and writes, reasoning tokens, `n > 1`, priority service tiers, per-request
fees, search models' per-call fees, OpenRouter's web plugin and fallback models, Anthropic's
web searches and long context, and calls billed and then failed or cut off.

    python -m infra.stub_provider --port 8900 --seed 7 [--prices-file table.json]

One app serves every API, so that one bill, one /control and one process judge every gateway
route. Each API is a module (infra/stub_chat.py, stub_responses.py, stub_messages.py; what
OpenAI's two share is stub_openai.py) on a shared core: the price table (stub_prices.py), token
counting (stub_tokens.py), the bill (stub_bill.py), faults and control (stub_faults.py).
  POST /v1/chat/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens
  POST /v1/conversations, GET /v1/conversations/{id}, POST /v1/conversations/{id}/items
                              OpenAI's conversations, read by a response that names one
  GET  /billing               the bill: tallies in total and per model, and a `log` of the most
                              recent requests (`?log=0` leaves the log out).
  POST /billing/reset         start a new bill (and empty the prompt caches and stored responses).
  GET, POST /control          faults and settings for the next calls (below).
  GET  /v1/organization/costs, /v1/organizations/cost_report
                              OpenAI's and Anthropic's cost reports of this bill, per UTC day, in
                              each one's format (infra/stub_costs.py; `/costs/control` sets them).
  GET  /health/live           200 while it answers.

Google (infra/stub_gemini.py, infra/stub_vertex.py; billed from the table's `gemini` entries):
  POST /{v1beta|v1}/models/{model}:generateContent, :streamGenerateContent?alt=sse, :countTokens
                              the Gemini API, key in x-goog-api-key or ?key= (--api-key)
  POST /{v1|v1beta1}/projects/{p}/locations/{r}/publishers/google/models/{model}:<same three>
                              Vertex AI's Gemini; bills as `vertex.gemini`
  POST /{v1|v1beta1}/projects/{p}/locations/{r}/publishers/anthropic/models/{model}:rawPredict,
       :streamRawPredict      Claude on Vertex, by the Messages API's code; `vertex.messages`;
                              +10% at a regional endpoint from Sonnet 4.5 on
  POST /token, GET /vertex/service_account
                              Vertex's OAuth token endpoint (JWT-bearer grant) and the service
                              account it knows; every Vertex call needs its bearer token
/control: `cached_contents` {name: {"model", "tokens"}} (Gemini's cachedContent), and
`thinking_outside_output_cap` (false: thinking counts inside maxOutputTokens, as Google serves
it). On Gemini routes `X-Stub-Web-Searches` (`web_searches`) is the Google Search queries a
grounded call runs, `X-Stub-Tool-Call: 1` calls the first declared function, and errors are in
Google's shape {"error": {"code", "message", "status"}}.

Output is at most the call's cap, drawn at random with mean `--output-tokens-mean` after a
latency in [`--latency-ms-min`, `--latency-ms-max`], from one random.Random(seed): calls made
one after another are reproducible.

When a call is billed: in full, once its answer is decided, before the first byte is sent,
whether or not the client is still there to read it. A call the stub refuses (bad request,
unknown model, wrong key, a fault that fails before serving) is not billed. Every request is
counted in `requests` and logged all the same.

Amazon Bedrock, Azure OpenAI and embeddings, each in its module and billed by the API it wraps:
  POST /v1/embeddings         OpenAI's embeddings: input tokens only, at an embedding model's
                              rate (a table entry with `embedding`; infra/stub_embeddings.py)
  POST /model/{modelId}/invoke, /model/{modelId}/invoke-with-response-stream,
       /model/{modelId}/count-tokens
                              Bedrock's runtime for Claude (infra/stub_bedrock.py): Messages
                              bodies, billed by infra/stub_messages.py at the table's entry of
                              the Bedrock model id (a geographic profile us., eu., ... at its
                              base id's in-region rates, `global.` at its own); SigV4 verified
                              with botocore (403 in AWS's shape, unbilled); the stream in AWS's
                              event-stream framing, `amazon-bedrock-invocationMetrics` on its
                              message_stop; errors `{"message"}` named in `x-amzn-ErrorType`
  POST /openai/v1/chat/completions, /openai/v1/responses, /openai/v1/embeddings, and the dated
       /openai/deployments/{name}/chat/completions, .../embeddings, /openai/responses
                              Azure OpenAI (infra/stub_azure.py): the OpenAI routes' own
                              billing, the key in `api-key` (or a bearer token), the body's
                              `model` (or the dated path's) a deployment; unknown: 404
                              `DeploymentNotFound`, unbilled
Their /control settings: `bedrock_credentials` {"access_key_id", "secret_access_key", "region",
"session_token", "api_key" (both optional)}, the one identity SigV4 is verified against (AWS's
documented example key pair in us-east-1 until set; GET shows it without the secrets) and the
Bedrock API key a bearer token must be (none until set); `deployments` {deployment:
model the table prices}, Azure's (none until set). The X-Stub-* faults and per-call headers work
on every one of them; a fault Bedrock reports in its stream after billing is an exception event
(infra/stub_bedrock.py).

OpenAI's stored prompts are registered by POST /control `prompts` {prompt id: {"tokens": N}}
(infra/stub_responses.py); `tool_calls` (below) script the OpenAI routes' tool calls too: the
first queued call whose function a call offers, in a namespace tool or not, is its answer.

Faults, per call by header, or for the next `calls` calls (all, when absent) by POST /control:
  X-Stub-Fail-Status: S          fail_status: S           answer S (400-599), bill nothing
  X-Stub-Hang: 1                 hang: true               never answer, bill nothing
  X-Stub-Fail-After-Billing: S   fail_after_billing: S    bill in full, then answer S
  X-Stub-Hang-After-Billing: 1   hang_after_billing: true bill in full, then never answer
  X-Stub-Break-After-Events: K   break_after_events: K    bill in full, send K stream events
                                                          (a non-stream: half its body), then
                                                          drop the connection
  X-Stub-Continuous-Usage: 1     continuous_usage: true   every chat chunk carries the usage so
                                                          far (vLLM's continuous_usage_stats)
  X-Stub-Cached-Tokens: N        cached_tokens: N         report and bill N prompt tokens cached
  X-Stub-Web-Searches: N         web_searches: N          Anthropic's web search tool runs N;
                                                          OpenAI's hosted web_search N (at
                                                          most the call's max_tool_calls)
Per call only: `X-Stub-Output-Tokens: N` answers exactly min(N, cap) tokens a choice;
`X-Stub-Reasoning-Tokens: N` makes N of them reasoning; `X-Stub-Tool-Call: 1` (Messages) calls
the first client tool. Headers win over /control, whose fault set each POST replaces (`{}`
clears it). Settings a POST gives replace theirs, and stay until set again: `images` {url:
[width, height]} for http(s) images the stub cannot fetch; `files` {file id, file URL or item
id: {"bytes": N, "pages": P, "image": [w, h]}}; `prompt_cache` (true by default);
`default_service_tier` and `upstream_fields` (infra/stub_openai.py); `web_search_result_tokens`
and `clock_offset_s` (infra/stub_messages.py); `answer_padding_bytes` (0): every answer that is
not streamed (200, on any route) carries that many bytes of whitespace after its opening brace,
still JSON, sent as they are made (chunked, with no length): an answer as large as a test
needs, at no memory to the stub.
`tool_calls` [{"name", "input" or "arguments"}]: scripted tool calls, a queue each API takes
from (infra/stub_faults.py, infra/stub_messages.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from infra.processes import free_port, tls_context, wait_ready
from infra.processes import stop as stop_process
from infra.stub_azure import CONTROL_FIELDS as AZURE_CONTROL_FIELDS
from infra.stub_azure import Azure, deployments_from
from infra.stub_bedrock import CONTROL_FIELDS as BEDROCK_CONTROL_FIELDS
from infra.stub_bedrock import Bedrock
from infra.stub_bill import Bill, CallRecord, Tally, Usage, usd
from infra.stub_chat import ChatApi
from infra.stub_costs import CostReports
from infra.stub_embeddings import EmbeddingsApi
from infra.stub_faults import (
    FAULT_HEADERS,
    SETTINGS,
    Api,
    ApiError,
    Decided,
    Fault,
    Settings,
    fault_from,
    hang,
    read_body,
    registry_files,
    registry_images,
    sent,
    stub_failure,
)
from infra.stub_messages import MessagesApi
from infra.stub_prices import StubPrices
from infra.stub_responses import CONTROL_FIELDS as RESPONSES_CONTROL_FIELDS
from infra.stub_responses import ResponsesApi, registry_prompts
from infra.stub_tokens import Registry
from infra.stub_vertex import CONTROL_FIELDS as GEMINI_CONTROL_FIELDS
from infra.stub_vertex import GoogleRoutes

__all__ = ["Bill", "CallRecord", "StubProvider", "StubProviderApp", "StubProviderProcess",
           "Tally", "Usage", "fetch_bill", "reset_bill", "stub_control", "usd"]

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
# A stub in a process of its own imports its dependencies first: seconds on a busy machine.
PROCESS_START_TIMEOUT_S = 30.0
# Idle keep-alive connections are kept this long (uvicorn's default is 5 s): a client reusing a
# pooled connection at the moment the server closes it gets a spurious read error.
KEEP_ALIVE_S = 120
# Calls still open at shutdown (a hung one) are cut after this long.
GRACEFUL_SHUTDOWN_S = 1
BILL_FETCH_TIMEOUT_S = 10.0
# The status logged for a call that was never answered (it hung until the client left).
STATUS_NO_ANSWER = 0
# The setting `answer_padding_bytes` pads answers in pieces of this size, made as they are sent.
PADDING_PIECE_BYTES = 1024 * 1024
# What /control sets of Bedrock's (its credentials) and Azure's (its deployments).
CLOUD_CONTROL_FIELDS = BEDROCK_CONTROL_FIELDS | AZURE_CONTROL_FIELDS

D = TypeVar("D", bound=Decided)


class StubProviderApp:
    """The provider's state (prices, random draws, bill, faults, settings, registry), its
    routes, and every call's flow under faults, whatever its API."""

    def __init__(
        self,
        *,
        seed: int,
        latency_ms_min: int,
        latency_ms_max: int,
        output_tokens_mean: int,
        prices: StubPrices,
        api_key: str | None = None,
        admin_key: str | None = None,
    ) -> None:
        if not 0 <= latency_ms_min <= latency_ms_max or output_tokens_mean < 1:
            raise ValueError("need 0 <= latency_ms_min <= latency_ms_max and a positive mean")
        self.rng = random.Random(seed)
        self.latency_ms_min, self.latency_ms_max = latency_ms_min, latency_ms_max
        self.output_tokens_mean = output_tokens_mean
        self.prices = prices
        self.api_key = api_key
        self.bill = Bill()
        # The bill per UTC day, read by the cost report routes with `admin_key` (any key when
        # None); a new bill starts a new book.
        self.costs = CostReports(admin_key)
        self.fault = Fault()
        self.settings = Settings()
        self.registry = Registry()
        # Google's Gemini API and Vertex AI (Gemini, and Claude by self.messages), with Vertex's
        # token endpoint (infra/stub_gemini.py, infra/stub_vertex.py).
        self.gemini = GoogleRoutes(self)
        openai_cache: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self.chat = ChatApi(self, openai_cache)
        self.responses = ResponsesApi(self, openai_cache)
        # Bedrock, Azure OpenAI and embeddings (infra/stub_bedrock.py, stub_azure.py,
        # stub_embeddings.py): Azure wraps the OpenAI routes, Bedrock the Messages API.
        self.embeddings = EmbeddingsApi(self)
        self.bedrock = Bedrock(self)
        self.azure = Azure(self)
        self.messages = MessagesApi(self)
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", partial(self.serve, self.chat), methods=["POST"]),
            Route("/v1/responses", partial(self.serve, self.responses), methods=["POST"]),
            Route("/v1/messages", partial(self.serve, self.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", self.messages.count_tokens, methods=["POST"]),
            Route("/v1/embeddings", partial(self.serve, self.embeddings), methods=["POST"]),
            *self.bedrock.routes(),
            *self.azure.routes(),
            *(Route(path, endpoint, methods=methods)
              for path, endpoint, methods in self.responses.routes_conversations()),
            Route("/billing", self.get_billing, methods=["GET"]),
            Route("/billing/reset", self.reset_billing, methods=["POST"]),
            Route("/control", self.control, methods=["GET", "POST"]),
            Route("/health/live", self.live, methods=["GET"]),
            *self.costs.routes(),
            *self.gemini.routes(),
        ])

    # -- routes ------------------------------------------------------------------------------

    async def get_billing(self, request: Request) -> Response:
        return JSONResponse(self.bill.to_json(with_log=request.query_params.get("log") != "0"))

    async def reset_billing(self, request: Request) -> Response:
        self.bill = Bill()
        self.costs.reset()
        for api in (self.chat, self.responses, self.messages):
            api.reset()
        self.bedrock.reset()
        return JSONResponse(self.bill.to_json())

    async def control(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                doc = await request.json()
                if not isinstance(doc, dict):
                    raise ValueError("the control body is an object")
                unknown = (set(doc) - SETTINGS - RESPONSES_CONTROL_FIELDS - CLOUD_CONTROL_FIELDS
                           - {*FAULT_HEADERS.values(), "calls"})
                unknown -= GEMINI_CONTROL_FIELDS
                if unknown:
                    raise ValueError(f"unknown control fields {sorted(unknown)}")
                fault = fault_from({k: v for k, v in doc.items() if k not in SETTINGS})
                images = registry_images(doc["images"]) if "images" in doc else None
                files = registry_files(doc["files"]) if "files" in doc else None
                prompts = registry_prompts(doc["prompts"]) if "prompts" in doc else None
                credentials = self.bedrock.control(doc)
                deployments = (deployments_from(doc["deployments"], self.prices)
                               if "deployments" in doc else None)
                settings = self.settings.updated(doc)
                gemini = self.gemini.controlled(doc)
            except (ValueError, TypeError) as exc:
                return self.chat.error(ApiError(400, f"control body: {exc}"), {})
            # Checked whole before anything changes: a refused body changes nothing.
            self.fault, self.settings = fault, settings
            self.gemini.apply(gemini)
            self.registry.images = self.registry.images if images is None else images
            self.bedrock.credentials = credentials or self.bedrock.credentials
            self.azure.deployments = (self.azure.deployments if deployments is None
                                      else deployments)
            self.registry.files = self.registry.files if files is None else files
            self.registry.prompts = self.registry.prompts if prompts is None else prompts
        return JSONResponse({**self.fault.to_json(), **vars(self.settings), **self.gemini.to_json(),
                             "images": {u: list(s) for u, s in self.registry.images.items()},
                             "bedrock_credentials": self.bedrock.credentials.to_json(),
                             "deployments": dict(self.azure.deployments),
                             "files": sorted(self.registry.files),
                             "prompts": dict(self.registry.prompts)})

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    # -- shared by every API -----------------------------------------------------------------

    def now_s(self) -> float:
        """The clock prompt caches expire by: monotonic, plus what /control skipped ahead."""
        return time.monotonic() + self.settings.clock_offset_s

    def latency_s(self) -> float:
        return self.rng.uniform(self.latency_ms_min, self.latency_ms_max) / 1000

    def draw_output_tokens(self) -> int:
        """One answer's length before any cap: at least 1, exponential around the mean."""
        return 1 + int(self.rng.expovariate(1 / self.output_tokens_mean))

    def take_fault(self, request: Request) -> Fault:
        """The fault for this call: its X-Stub-* headers, else the next of /control's.

        Raises ValueError for a header that does not parse."""
        given = {f: request.headers[h] for h, f in FAULT_HEADERS.items() if h in request.headers}
        if given:
            return fault_from(given)
        if self.fault.active:
            if self.fault.calls_left is not None:
                self.fault.calls_left -= 1
            return replace(self.fault, calls_left=None)
        return Fault()

    def log(self, api: str, model: str | None, status: int, stream: bool, fault: Fault) -> None:
        """A request that was not billed."""
        self.bill.record(CallRecord(api=api, model=model, status=status, billed=False,
                                    cost_micros=0, usage=None, stream=stream, fault=fault.name))

    async def serve(self, api: Api[D], request: Request) -> Response:
        """One call on `api`: checked, decided, billed before its first byte, then answered,
        or not, as its fault says."""
        self.bill.requests += 1
        headers = api.headers()
        model: str | None = None
        stream = False
        fault = Fault()
        try:
            betas = api.check(request)
            try:
                fault = self.take_fault(request)
            except ValueError as exc:
                raise ApiError(400, f"X-Stub-* header: {exc}") from exc
            if fault.hang:
                await hang(request)
                self.log(api.name, model, STATUS_NO_ANSWER, stream, fault)
                return Response(status_code=504)  # nobody reads it: the client has gone
            if fault.fail_status is not None:
                raise stub_failure(fault.fail_status, "on request")
            body = await read_body(request, api.request_bytes_max)
            model = api.model_of(body, request)
            stream = api.streams(body, request)
            decided = api.decide(body, request, fault, betas)
        except ApiError as exc:
            self.log(api.name, model, exc.status, stream, fault)
            return api.error(exc, headers)
        headers.update(api.answer_headers(decided))
        await asyncio.sleep(self.latency_s())
        # Billed here, before the first byte, whether or not the client is still there.
        status = fault.fail_after_billing or (STATUS_NO_ANSWER if fault.hang_after_billing
                                              else 200)
        self.bill.record(CallRecord(
            api=api.name, model=decided.model, status=status, billed=True,
            cost_micros=decided.cost_micros, usage=decided.usage, stream=stream,
            service_tier=decided.service_tier, fault=fault.name,
            model_requested=decided.model_requested, beyond_body=decided.beyond_body,
        ))
        self.costs.book.record(api.name, decided.service_tier, decided.cost_micros, time.time())
        api.charged(decided, fault)
        if fault.hang_after_billing:
            await hang(request)
            return Response(status_code=504)
        if fault.fail_after_billing is not None:
            failure = stub_failure(fault.fail_after_billing, "after the call was billed")
            events = api.failed_events(decided, failure) if stream else None
            if events is None:
                return api.error(failure, headers)
            return StreamingResponse(sent(events, broken=False), headers=headers,
                                     media_type=api.stream_media_type)
        broken = fault.break_after_events is not None
        if stream:
            events = api.events(decided, fault)
            if fault.break_after_events is not None:
                events = events[:min(fault.break_after_events, len(events) - 1)]
            return StreamingResponse(sent(events, broken=broken), headers=headers,
                                     media_type=api.stream_media_type)
        doc = api.body(decided)
        if broken:
            raw = json.dumps(doc).encode()
            return StreamingResponse(sent([raw[:len(raw) // 2]], broken=True), headers=headers,
                                     media_type="application/json")
        answer = JSONResponse(doc, headers=headers)
        if not self.settings.answer_padding_bytes:
            return answer
        # A whole JSON answer with whitespace after its opening brace, sent as it is made.
        answer_headers = {k: v for k, v in answer.headers.items() if k != "content-length"}
        return StreamingResponse(padded(bytes(answer.body), self.settings.answer_padding_bytes),
                                 headers=answer_headers)


# -- running it ------------------------------------------------------------------------------


@dataclass
class StubProvider:
    """The stub on a free loopback port, served by uvicorn on a thread of this process.

    A thread, not a process: the harness that starts it is otherwise idle while calls run, and
    stopping it needs no pid. `python -m infra.stub_provider` runs the same app as a process.
    `prices` is a table of the stub's own (a JSON file's path or its parsed document), merged
    over the default table; never the service's CEILING_PRICES_FILE.
    """

    seed: int = 0
    latency_ms_min: int = 20
    latency_ms_max: int = 200
    output_tokens_mean: int = 250
    prices: str | Path | dict[str, Any] | None = None
    api_key: str | None = None
    admin_key: str | None = None
    port: int = field(default_factory=free_port)
    _server: uvicorn.Server | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> StubProviderApp:
        return StubProviderApp(
            seed=self.seed, latency_ms_min=self.latency_ms_min,
            latency_ms_max=self.latency_ms_max, output_tokens_mean=self.output_tokens_mean,
            prices=StubPrices.load(self.prices), api_key=self.api_key,
            admin_key=self.admin_key,
        )

    def start(self) -> StubProvider:
        self._server = uvicorn.Server(server_config(self.app(), self.port))
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


@dataclass
class StubProviderProcess(StubProvider):
    """The stub in an OS process of its own, stopped by pid: a drop-in for the thread, for a
    harness whose own event loop is busy (a load generator), which would otherwise share its
    interpreter lock with the stub and add its waits to the latencies it measures."""

    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _prices_dir: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False,
                                                                 repr=False)

    def start(self) -> StubProviderProcess:
        argv = [sys.executable, "-m", "infra.stub_provider", "--port", str(self.port),
                "--seed", str(self.seed), "--latency-ms-min", str(self.latency_ms_min),
                "--latency-ms-max", str(self.latency_ms_max),
                "--output-tokens-mean", str(self.output_tokens_mean)]
        if self.api_key is not None:
            argv += ["--api-key", self.api_key]
        if self.admin_key is not None:
            argv += ["--admin-key", self.admin_key]
        if isinstance(self.prices, dict):
            self._prices_dir = tempfile.TemporaryDirectory()
            path = Path(self._prices_dir.name) / "prices.json"
            path.write_text(json.dumps(self.prices))
            argv += ["--prices-file", str(path)]
        elif self.prices is not None:
            argv += ["--prices-file", str(self.prices)]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        with httpx.Client(timeout=1.0, verify=tls_context()) as client:

            def live() -> bool:
                try:
                    return client.get(f"{self.url}/health/live").status_code == 200
                except httpx.HTTPError:
                    return False

            try:
                wait_ready(self.process, live, timeout_s=PROCESS_START_TIMEOUT_S,
                           what=f"the stub provider on port {self.port}")
            except RuntimeError:
                self.process = None  # wait_ready stopped it
                self._forget_prices()
                raise
        return self

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None
        self._forget_prices()

    def _forget_prices(self) -> None:
        if self._prices_dir is not None:
            self._prices_dir.cleanup()
            self._prices_dir = None


async def padded(body: bytes, padding_bytes: int) -> AsyncIterator[bytes]:
    """`body`, a JSON object, with `padding_bytes` of spaces after its opening brace."""
    yield body[:1]
    piece = b" " * min(padding_bytes, PADDING_PIECE_BYTES)
    left = padding_bytes
    while left > len(piece):
        yield piece
        left -= len(piece)
    yield piece[:left]
    yield body[1:]


def server_config(app: StubProviderApp, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app.app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
        lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def fetch_bill(provider_url: str, *, with_log: bool = True) -> Bill:
    response = httpx.get(f"{provider_url}/billing", params={"log": int(with_log)},
                         timeout=BILL_FETCH_TIMEOUT_S, verify=tls_context())
    response.raise_for_status()
    return Bill.from_json(response.json())


def stub_control(provider_url: str, settings: dict[str, Any]) -> None:
    """Faults and settings of the stub's next calls (a fault set replaces the last one)."""
    httpx.post(f"{provider_url}/control", json=settings, timeout=BILL_FETCH_TIMEOUT_S,
               verify=tls_context()).raise_for_status()


def reset_bill(provider_url: str) -> None:
    httpx.post(f"{provider_url}/billing/reset", timeout=BILL_FETCH_TIMEOUT_S,
               verify=tls_context()).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-ms-min", type=int, default=StubProvider.latency_ms_min)
    parser.add_argument("--latency-ms-max", type=int, default=StubProvider.latency_ms_max)
    parser.add_argument("--output-tokens-mean", type=int, default=StubProvider.output_tokens_mean)
    parser.add_argument("--prices-file", help="the stub's own price table (infra/stub_prices.py "
                        "format), merged over its default table")
    parser.add_argument("--api-key", help="refuse calls without this key (401): a bearer token, "
                        "or Anthropic's x-api-key on /v1/messages")
    parser.add_argument("--admin-key", help="refuse cost reports without this admin key (401)")
    args = parser.parse_args()
    stub = StubProvider(seed=args.seed, latency_ms_min=args.latency_ms_min,
                        latency_ms_max=args.latency_ms_max,
                        output_tokens_mean=args.output_tokens_mean, prices=args.prices_file,
                        api_key=args.api_key, admin_key=args.admin_key, port=args.port)
    uvicorn.Server(server_config(stub.app(), args.port)).run()


if __name__ == "__main__":
    main()
