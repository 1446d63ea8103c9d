"""What the cloud upstreams' tests share: the stub provider (the witness each upstream is judged
by: its bill), read and reset over HTTP, and a port where nothing listens."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx
import pytest

from core.formats import FORMATS, Api, Plan, StreamTally
from core.prices.rates import Usage
from core.upstream import Sent
from infra.stub_bill import Bill, CallRecord
from infra.stub_provider import StubProvider

# A stub call takes milliseconds; past this, the stub hangs.
CALL_TIMEOUT_S = 10.0
# A hang is given up on this fast.
HANG_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=37, latency_ms_min=0, latency_ms_max=2) as stub:
        yield stub


@pytest.fixture(scope="module")
def http(provider: StubProvider) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=provider.url, timeout=CALL_TIMEOUT_S) as client:
        yield client


def start_fresh(http: httpx.Client, control: dict[str, Any]) -> None:
    http.post("/control", json=control).raise_for_status()
    http.post("/billing/reset").raise_for_status()


def bill_of(http: httpx.Client) -> Bill:
    return Bill.from_json(http.get("/billing").json())


def only_call(http: httpx.Client) -> CallRecord:
    [call] = bill_of(http).log
    return call


def closed_port_url() -> str:
    """A loopback URL nothing listens at: a connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def deadline(timeout_s: float = CALL_TIMEOUT_S) -> float:
    return asyncio.get_running_loop().time() + timeout_s


async def streamed(sent: Sent) -> bytes:
    assert not isinstance(sent[2], bytes)
    return b"".join([chunk async for chunk in sent[2]])


def tallied(call_plan: Plan, raw: bytes) -> StreamTally:
    tally = StreamTally(call_plan)
    tally.feed(raw)
    return tally


def answer_usage(call_plan: Plan, body: bytes | AsyncGenerator[bytes, None]) -> Usage | None:
    assert isinstance(body, bytes)
    return call_plan.wire.answer_usage(json.loads(body))


def same_tokens(usage: Usage | None, call: CallRecord) -> bool:
    """The gateway's reading of the answer's usage is the stub's bill's."""
    assert usage is not None
    assert call.usage is not None
    return (usage.input_tokens, usage.output_tokens, usage.cached_input_tokens,
            usage.cache_write_tokens) == (call.usage.input_tokens, call.usage.output_tokens,
                                          call.usage.cached_input_tokens,
                                          call.usage.cache_write_tokens)


def gemini_plan(model: str, *, stream: bool = False) -> Plan:
    """A Gemini call as the Gemini format will plan it: the model its route's path names, the
    body as the client sent it, 10 tokens of output and no thinking forced on the stub. The
    format is not in core/formats yet: a stand-in wire, of which the upstreams read only that
    its api is not Messages."""
    body = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}],
            "generationConfig": {"maxOutputTokens": 100}}
    return Plan(wire=FORMATS[Api.CHAT], model=model, body=body, stream=stream,
                text_tokens_max=9, output_tokens_max=100, choices=1, usage_wanted=False,
                headers=(("X-Stub-Output-Tokens", "10"), ("X-Stub-Reasoning-Tokens", "0")))


def gemini_usage_is_billed(usage: dict[str, Any], call: CallRecord) -> bool:
    """A Gemini answer's usageMetadata is what the stub billed: its prompt, and its
    candidates and thoughts as output."""
    assert call.usage is not None
    return (usage["promptTokenCount"],
            usage["candidatesTokenCount"] + usage.get("thoughtsTokenCount", 0)) == (
        call.usage.input_tokens, call.usage.output_tokens)
