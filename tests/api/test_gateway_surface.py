"""The OpenAI surface end to end (issue 15): each kind of call the gateway forwards, through the
real `openai` SDK, charged what the stub provider billed for it, to the micro-dollar.

The Responses API streamed and not (its usage from response.completed), reasoning models whose
reasoning tokens are output, prompt-cache reads at the cached rate, and chat with n > 1 streamed
and not. The service prices real models from genai-prices' bundled table and the stub from its
own (infra/stub_prices.json); every call is judged by the stub's bill: each call's charge (from
its headers, or for a stream the ledger's books after it) equals its bill, and its hold is at
least its bill.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_bill import CallRecord
from infra.stub_provider import StubProvider, fetch_bill, reset_bill, stub_control
from tests.api.conftest import (
    Client,
    FaultProxy,
    account,
    gateway,
    header,
    ledger,
    sdk,
    settled,
)

HELLO: list[Any] = [{"role": "user", "content": "hello"}]
# A shared prefix of ~1,500 tokens: above OpenAI's 1,024-token caching minimum.
MANUAL = "You answer from this manual. " + "Rule. " * 1_000
MANUAL_CHAT: list[Any] = [{"role": "system", "content": MANUAL}, *HELLO]
OUTPUT_TOKENS = 250


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=21, latency_ms_min=0, latency_ms_max=2,
                      output_tokens_mean=200) as provider:
        yield provider


@pytest.fixture(scope="module")
def proxy(stub: StubProvider) -> Iterator[FaultProxy]:
    """Every answer is OUTPUT_TOKENS long (or its cap), each choice: a reasoning model's answer
    then always has reasoning tokens and text."""
    with FaultProxy(stub.port) as p:
        p.output_tokens = OUTPUT_TOKENS
        yield p


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, proxy: FaultProxy,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    prices = Path(tmp_path_factory.mktemp("surface")) / "prices.json"
    prices.write_text(json.dumps({"models": {}}))  # the bundled table only
    with gateway(redis_server, str(prices), f"{proxy.url}/v1", 30) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_bill(stub: StubProvider) -> None:
    stub_control(stub.url, {"prompt_cache": True, "default_service_tier": "default"})
    reset_bill(stub.url)


@dataclass(frozen=True)
class Kind:
    """Calls of one kind, sent one after another; `stream`: read as streams."""

    name: str
    call: Callable[[openai.OpenAI], Any]  # sent twice: the second reads what the first cached
    stream: bool
    billed: Callable[[list[CallRecord]], bool]  # what the bill must show of this kind


def read(raw: Any) -> Any:
    """The answer (a stream read to its end); the raw response keeps its headers."""
    answer = raw.parse()
    return list(answer) if isinstance(answer, openai.Stream) else answer


def reasoning(records: list[CallRecord]) -> bool:
    return all(r.usage is not None and 0 < r.usage.reasoning_tokens < r.usage.output_tokens
               for r in records)


def cached(records: list[CallRecord]) -> bool:
    return records[-1].usage is not None and records[-1].usage.cached_input_tokens > 0


KINDS = [
    Kind("responses", (lambda c: c.responses.with_raw_response.create(
        model="gpt-4o-mini", instructions=MANUAL, input="hello", max_output_tokens=300)),
        stream=False, billed=cached),
    Kind("responses, streamed", (lambda c: c.responses.with_raw_response.create(
        model="gpt-4o-mini", instructions=MANUAL, input="hello", max_output_tokens=300,
        stream=True)), stream=True, billed=cached),
    Kind("responses, reasoning", (lambda c: c.responses.with_raw_response.create(
        model="o4-mini", instructions=MANUAL, input="hello", max_output_tokens=600,
        reasoning={"effort": "high"})), stream=False,
        billed=lambda r: reasoning(r) and cached(r)),
    Kind("responses, reasoning, streamed", (lambda c: c.responses.with_raw_response.create(
        model="o4-mini", instructions=MANUAL, input="hello", max_output_tokens=600,
        reasoning={"effort": "high"}, stream=True)), stream=True,
        billed=lambda r: reasoning(r) and cached(r)),
    Kind("chat, reasoning model", (lambda c: c.chat.completions.with_raw_response.create(
        model="o4-mini", messages=MANUAL_CHAT, max_completion_tokens=600,
        reasoning_effort="medium")), stream=False, billed=lambda r: reasoning(r) and cached(r)),
    Kind("chat, cached prefix", (lambda c: c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=MANUAL_CHAT, max_tokens=100)), stream=False,
        billed=cached),
    Kind("chat, n = 3", (lambda c: c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=HELLO, max_tokens=100, n=3)), stream=False,
        billed=lambda r: all(x.usage is not None and x.usage.output_tokens == 300 for x in r)),
    Kind("chat, n = 3, streamed", (lambda c: c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=HELLO, max_tokens=100, n=3, stream=True)), stream=True,
        billed=lambda r: all(x.usage is not None and x.usage.output_tokens == 300 for x in r)),
]


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_each_kind_of_call_is_charged_what_the_provider_billed_for_it(
    gw: ServiceProcess, admin: Client, stub: StubProvider, kind: Kind
) -> None:
    tag, key = account(admin, 10_000_000)
    client = sdk(gw, key)
    raws, charged, before = [], [], 0
    for _ in range(2):
        raw = kind.call(client)
        raws.append(raw)
        read(raw)
        if kind.stream:  # its charge follows the stream: the books after it
            committed = settled(admin, tag)["committed_micros"]
            charged.append(committed - before)
            before = committed
        else:
            charged.append(header(raw, "x-ceiling-charged-micros"))
            assert raw.headers["x-ceiling-billing-outcome"] == "billed"
    records = list(fetch_bill(stub.url).log)
    assert [r.status for r in records] == [200] * len(raws)
    assert charged == [r.cost_micros for r in records]
    assert all(header(raw, "x-ceiling-reserved-micros") >= r.cost_micros
               for raw, r in zip(raws, records, strict=True))
    assert kind.billed(records), [r.usage for r in records]
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (
        sum(r.cost_micros for r in records), 0)
    print(f"\nsurface | {kind.name} | billed {[r.cost_micros for r in records]} | "
          f"held {[header(raw, 'x-ceiling-reserved-micros') for raw in raws]}")


def test_n_choices_are_each_answered_and_held_for(gw: ServiceProcess, admin: Client,
                                                  stub: StubProvider) -> None:
    """n = 3 answers three choices, each up to the cap; the hold is the cap three times."""
    _, key = account(admin, 10_000_000)
    chat = sdk(gw, key).chat.completions
    one = chat.with_raw_response.create(model="gpt-4o-mini", messages=HELLO, max_tokens=100)
    three = chat.with_raw_response.create(model="gpt-4o-mini", messages=HELLO, max_tokens=100,
                                          n=3)
    assert len(three.parse().choices) == 3
    # gpt-4o-mini: $0.60 a million out, 200 more output tokens held.
    assert header(three, "x-ceiling-reserved-micros") - header(
        one, "x-ceiling-reserved-micros") >= 200 * 0.6
    streamed = list(chat.create(model="gpt-4o-mini", messages=HELLO, max_tokens=100, n=3,
                                stream=True))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1, 2}
