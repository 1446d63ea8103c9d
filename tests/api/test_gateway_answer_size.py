"""A non-streamed answer is held in memory at most up to api/upstream.py UPSTREAM_ANSWER_BYTES_MAX.

Larger, it is refused `502 upstream_answer_too_large` in the route's provider's error shape, and
its hold is kept as an unknown outcome: the provider ran and billed the call, and the usage at
the end of its answer was never read. The stub provider (its `answer_padding_bytes` setting)
answers as large as a test asks, whitespace inside a valid JSON answer, made as it is sent; its
bill is the witness of what was billed, and the gateway process's /proc status of what it held.
The provider client's reading is proved on its own too, against a loopback provider that
declares a length or compresses its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from starlette.responses import JSONResponse

from api.upstream import UPSTREAM_ANSWER_BYTES_MAX, Upstream
from core.formats import Api
from core.gateway_request import plan
from core.replies import REPLY_BYTES_MAX
from core.upstream import AnswerTooLarge
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, Tally, fetch_bill, stub_control
from tests.api.conftest import (
    Client,
    account,
    anthropic_sdk,
    as_key,
    gateway,
    header,
    ledger,
)
from tests.api.hostile import blocking, books, expire_held

MODELS = iter(f"as-m{i:02d}" for i in range(16))
# The test models' rates: one micro-dollar an input token, four an output token.
RATES = {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "4.00"}
SONNET = "claude-sonnet-4-5"
MESSAGES = [{"role": "user", "content": "hello"}]
# Far past the cap: the stub makes its padding as it is sent, so only what the gateway reads of
# it is ever made, and the gateway's memory can be held to the cap rather than to this.
HUGE_ANSWER_BYTES = 1024 * 1024 * 1024
# An answer under the cap, and above what an idempotency key keeps for replay.
LARGE_ANSWER_BYTES = 24 * 1024 * 1024
# What one refused call may add to the gateway's peak memory: the cap read in chunks, with room
# for the allocator's rounding and the event loop's buffers.
PEAK_GROWTH_BYTES_MAX = 2 * UPSTREAM_ANSWER_BYTES_MAX


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    table = {"models": {f"as-m{i:02d}": RATES for i in range(16)}}
    with StubProvider(seed=23, latency_ms_min=0, latency_ms_max=2, output_tokens_mean=120,
                      prices=table) as provider:
        yield provider


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, stub: StubProvider,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    prices = Path(tmp_path_factory.mktemp("answer_size")) / "prices.json"
    prices.write_text(json.dumps({"models": {f"as-m{i:02d}": RATES for i in range(16)}}))
    with gateway(redis_server, str(prices), f"{stub.url}/v1", 30,
                 {"CEILING_ANTHROPIC_URL": stub.url}) as service:
        yield service


@pytest.fixture(autouse=True)
def no_padding(stub: StubProvider) -> Iterator[None]:
    yield
    stub_control(stub.url, {"answer_padding_bytes": 0})


@pytest.fixture
def model() -> str:
    return next(MODELS)


def memory_bytes(pid: int) -> dict[str, int]:
    """The process's resident memory now (VmRSS) and at its peak so far (VmHWM)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024  # kB
    return fields


def billed(stub: StubProvider, model: str) -> Tally:
    return fetch_bill(stub.url).by_model.get(model, Tally())


def chat(gw: ServiceProcess, key: str, model: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", headers={**as_key(key), **headers},
                      json={"model": model, "messages": MESSAGES, "max_tokens": 100},
                      timeout=30)


# First in the module: the instance's peak memory is measured from this test's start, before any
# large answer of the others raised it.
def test_an_answer_over_the_cap_is_refused_held_charged_and_never_held_whole(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
    model: str
) -> None:
    tag, key = account(admin, 10_000_000)
    assert chat(gw, key, model).status_code == 200  # the provider's client made, and warm
    assert gw.process is not None
    before = memory_bytes(gw.process.pid)
    stub_control(stub.url, {"answer_padding_bytes": HUGE_ANSWER_BYTES})
    idempotency_key = uuid.uuid4().hex
    refused = chat(gw, key, model, **{"Idempotency-Key": idempotency_key})
    after = memory_bytes(gw.process.pid)

    assert refused.status_code == 502, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("upstream_answer_too_large", "upstream_error")
    assert error["answer_bytes_max"] == UPSTREAM_ANSWER_BYTES_MAX
    held = header(refused, "x-ceiling-reserved-micros")
    assert header(refused, "x-ceiling-charged-micros") == held
    assert refused.headers["x-ceiling-billing-outcome"] == "unknown"
    assert refused.headers["x-should-retry"] == "false"
    # The provider ran the call and billed it: the hold stays, and expiry charges it.
    bill = billed(stub, model)
    assert bill.calls == 2
    refused_cost = fetch_bill(stub.url).log[-1].cost_micros
    assert 0 < refused_cost <= held
    period = ledger(admin, tag)
    assert period["reserved_micros"] == held
    assert period["committed_micros"] == bill.cost_micros - refused_cost  # the warm-up's
    assert blocking(expire_held(redis_server.url, tag)) == 1
    leg = blocking(books(redis_server.url, tag))
    assert (leg.committed_micros, leg.reserved_micros) == (
        bill.cost_micros - refused_cost + held, 0)
    assert leg.committed_micros >= bill.cost_micros

    peak_growth = after["VmHWM"] - before["VmRSS"]
    print(f"\nanswer {HUGE_ANSWER_BYTES} bytes, cap {UPSTREAM_ANSWER_BYTES_MAX}: gateway RSS "
          f"{before['VmRSS'] >> 20} -> {after['VmRSS'] >> 20} MiB, peak "
          f"{before['VmHWM'] >> 20} -> {after['VmHWM'] >> 20} MiB")
    assert peak_growth < PEAK_GROWTH_BYTES_MAX < HUGE_ANSWER_BYTES // 8

    # Nothing was kept for the key: the retry is a new call (the stub answers it small now).
    stub_control(stub.url, {"answer_padding_bytes": 0})
    retried = chat(gw, key, model, **{"Idempotency-Key": idempotency_key})
    assert retried.status_code == 200
    assert "x-ceiling-replayed" not in retried.headers
    assert billed(stub, model).calls == 3


def test_an_answer_under_the_cap_is_relayed_unchanged_and_settled_from_its_usage(
    gw: ServiceProcess, admin: Client, stub: StubProvider, model: str
) -> None:
    tag, key = account(admin, 10_000_000)
    stub_control(stub.url, {"answer_padding_bytes": LARGE_ANSWER_BYTES})
    idempotency_key = uuid.uuid4().hex
    answer = chat(gw, key, model, **{"Idempotency-Key": idempotency_key})
    assert answer.status_code == 200, answer.text[:500]
    body = answer.content
    assert len(body) > LARGE_ANSWER_BYTES
    # Byte for byte what the stub sent: its padding, then its answer as Starlette renders it.
    padding = b"{" + b" " * LARGE_ANSWER_BYTES
    assert body.startswith(padding)
    doc = json.loads(body)
    assert bytes(JSONResponse(doc).body) == b"{" + body[len(padding):]
    bill = billed(stub, model)
    usage = doc["usage"]
    assert (bill.calls, bill.output_tokens) == (1, usage["completion_tokens"])
    assert header(answer, "x-ceiling-charged-micros") == bill.cost_micros > 0
    assert answer.headers["x-ceiling-billing-outcome"] == "billed"
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (bill.cost_micros, 0)
    # Settled, but too large to keep for replay: a retry learns what became of the call and what
    # it was charged, and is not sent again.
    assert len(body) > REPLY_BYTES_MAX
    replayed = chat(gw, key, model, **{"Idempotency-Key": idempotency_key})
    assert (replayed.status_code, replayed.headers.get("x-ceiling-replayed")) == (409, "true")
    error = replayed.json()["error"]
    assert (error["code"], error["outcome"], error["charged_micros"]) == (
        "reply_not_kept", "billed", bill.cost_micros)
    assert billed(stub, model).calls == 1


def test_a_messages_answer_over_the_cap_is_refused_in_anthropics_shape(
    gw: ServiceProcess, admin: Client, stub: StubProvider
) -> None:
    tag, key = account(admin, 10_000_000)
    calls = fetch_bill(stub.url).total.calls
    stub_control(stub.url, {"answer_padding_bytes": HUGE_ANSWER_BYTES})
    with pytest.raises(anthropic.APIStatusError) as refused:
        anthropic_sdk(gw, key).messages.create(model=SONNET, max_tokens=100, messages=MESSAGES)
    assert refused.value.status_code == 502
    body: Any = refused.value.body
    assert body["type"] == "error"
    assert (body["error"]["type"], body["error"]["code"]) == (
        "api_error", "upstream_answer_too_large")
    response = refused.value.response
    assert response.headers["x-ceiling-billing-outcome"] == "unknown"
    assert fetch_bill(stub.url).total.calls == calls + 1
    held = header(response, "x-ceiling-reserved-micros")
    assert held >= fetch_bill(stub.url).log[-1].cost_micros > 0
    assert ledger(admin, tag)["reserved_micros"] == held


# -- the provider's client, alone -----------------------------------------------------------------


LIMIT_BYTES = 64 * 1024
ANSWER = json.dumps({"id": "x", "choices": [], "usage": {
    "prompt_tokens": 1, "completion_tokens": 1}}).encode()


@contextlib.asynccontextmanager
async def provider(head: bytes, body: bytes) -> AsyncIterator[str]:
    """A loopback provider that reads a request and answers `head` then `body`."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(head + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client hung up before the whole answer: what the cap makes it do
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.close()


async def read_from(url: str) -> bytes:
    up = Upstream(url, None, 5.0, answer_bytes_max=LIMIT_BYTES)
    try:
        call_plan = plan(Api.CHAT, json.dumps({
            "model": "m", "messages": MESSAGES, "max_tokens": 5}).encode())
        response = await up.open(call_plan)
        return await up.read(response)
    finally:
        await up.aclose()


def head(length: int, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(length).encode() + b"\r\n" + extra + b"\r\n")


async def test_an_answer_at_the_limit_is_read_whole() -> None:
    body = b"{" + b" " * (LIMIT_BYTES - len(ANSWER)) + ANSWER[1:]
    assert len(body) == LIMIT_BYTES
    async with provider(head(len(body)), body) as url:
        assert await read_from(url) == body


async def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    async with provider(head(LIMIT_BYTES + 1), b"{" + b" " * LIMIT_BYTES) as url:
        with pytest.raises(AnswerTooLarge, match="declares"):
            await read_from(url)


async def test_a_compressed_answer_is_held_to_the_limit_decoded() -> None:
    # A few KB on the wire, a hundred times the limit decoded.
    body = gzip.compress(b"{" + b" " * (100 * LIMIT_BYTES) + ANSWER[1:])
    assert len(body) < LIMIT_BYTES
    async with provider(head(len(body), b"content-encoding: gzip\r\n"), body) as url:
        with pytest.raises(AnswerTooLarge, match="passed"):
            await read_from(url)
    small = gzip.compress(ANSWER)
    async with provider(head(len(small), b"content-encoding: gzip\r\n"), small) as url:
        assert await read_from(url) == ANSWER
