"""The Gemini API upstream (api/upstreams/gemini.py) against the stub's Gemini API, which checks
the key in `x-goog-api-key`: each call judged by the stub's bill, read from the answer's
usageMetadata. And the clients CEILING_UPSTREAMS makes (api/upstreams client_of), one per kind."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import httpx
import pytest

from api.upstream import Upstream
from api.upstreams import client_of, made
from api.upstreams.azure import AzureUpstream
from api.upstreams.bedrock import BedrockUpstream
from api.upstreams.gemini import GeminiUpstream
from core.formats import Api
from core.upstream import NotSent, Unanswered
from core.upstreams import parse
from infra.stub_provider import StubProvider
from tests.api.upstreams.conftest import (
    HANG_TIMEOUT_S,
    bill_of,
    closed_port_url,
    deadline,
    gemini_plan,
    gemini_usage_is_billed,
    only_call,
    start_fresh,
    streamed,
)

KEY = "gemini-stub-key"
FLASH = "gemini-2.5-flash"


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=39, latency_ms_min=0, latency_ms_max=2, api_key=KEY) as stub:
        yield stub


def gemini_upstream(base_url: str, key: str = KEY) -> GeminiUpstream:
    definition = parse({"upstreams": [{"name": "google", "api": "gemini", "base_url": base_url,
                                       "api_key_env": "GEMINI_KEY", "models": [FLASH]}]},
                       {"GEMINI_KEY": key}).by_name["google"]
    return GeminiUpstream(definition, 10.0)


@pytest.fixture
async def google(provider: StubProvider) -> AsyncIterator[GeminiUpstream]:
    upstream = gemini_upstream(provider.url)
    yield upstream
    await upstream.aclose()


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"clock_offset_s": 0})


async def test_an_answer_reports_what_was_billed(google: GeminiUpstream,
                                                 http: httpx.Client) -> None:
    sent = await google.send(gemini_plan(FLASH), deadline())
    assert sent[0] == 200
    assert isinstance(sent[2], bytes)
    call = only_call(http)
    assert (call.api, call.model, call.billed) == ("gemini", FLASH, True)
    assert gemini_usage_is_billed(json.loads(sent[2])["usageMetadata"], call)


async def test_the_url_names_the_model_as_sent_not_as_priced(google: GeminiUpstream,
                                                              http: httpx.Client) -> None:
    """A routed call priced by one name and sent by another (Plan.sent_model): the path names
    the model the upstream knows, whatever the call is priced as."""
    call_plan = replace(gemini_plan(FLASH), model="priced-as-another-name", sent_model=FLASH)
    sent = await google.send(call_plan, deadline())
    assert sent[0] == 200, sent[2]
    assert only_call(http).model == FLASH


async def test_a_stream_ends_on_the_billed_usage(google: GeminiUpstream,
                                                 http: httpx.Client) -> None:
    sent = await google.send(gemini_plan(FLASH, stream=True), deadline())
    assert sent[0] == 200
    raw = await streamed(sent)
    chunks = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
              if line.startswith(b"data: ")]
    call = only_call(http)
    assert call.stream
    assert gemini_usage_is_billed(chunks[-1]["usageMetadata"], call)


async def test_a_wrong_key_is_refused_unbilled(provider: StubProvider,
                                               http: httpx.Client) -> None:
    upstream = gemini_upstream(provider.url, key="wrong")
    try:
        sent = await upstream.send(gemini_plan(FLASH), deadline())
    finally:
        await upstream.aclose()
    assert sent[0] == 400  # Google's answer to a key it does not know
    assert isinstance(sent[2], bytes)
    assert json.loads(sent[2])["error"]["status"] == "INVALID_ARGUMENT"
    assert bill_of(http).total.calls == 0


async def test_failures_are_sorted_by_what_they_prove(google: GeminiUpstream,
                                                      http: httpx.Client) -> None:
    upstream = gemini_upstream(closed_port_url())
    try:
        with pytest.raises(NotSent):
            await upstream.send(gemini_plan(FLASH), deadline())
    finally:
        await upstream.aclose()
    start_fresh(http, {"hang": True})
    with pytest.raises(Unanswered):
        await google.send(gemini_plan(FLASH), deadline(HANG_TIMEOUT_S))
    start_fresh(http, {"break_after_events": 1})
    sent = await google.send(gemini_plan(FLASH, stream=True), deadline())
    with pytest.raises(Unanswered):
        await streamed(sent)


async def test_count_tokens_is_free(google: GeminiUpstream, http: httpx.Client) -> None:
    content = json.dumps({"contents": [{"role": "user", "parts": [{"text": "hello"}]}]})
    sent = await google.count(Api.GEMINI, content.encode(), (), FLASH)
    assert sent[0] == 200
    assert isinstance(sent[2], bytes)
    assert json.loads(sent[2])["totalTokens"] == 9
    assert [c.billed for c in bill_of(http).log] == [False]


def test_each_kind_of_upstream_gets_its_client() -> None:
    # (vertex's needs a service account's key: tests/api/upstreams/test_vertex.py makes one)
    env = {"KEY": "k", "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
    defined = parse({"upstreams": [
        {"name": "oai", "api": "openai", "base_url": "http://x/v1", "api_key_env": "KEY",
         "models": ["gpt-4o"]},
        {"name": "ant", "api": "anthropic", "base_url": "http://x", "api_key_env": "KEY",
         "models": ["claude-sonnet-4-5"]},
        {"name": "az", "api": "azure", "base_url": "http://x/openai/v1", "api_key_env": "KEY",
         "deployments": {"prod": "gpt-4o"}},
        {"name": "br", "api": "bedrock", "region": "us-east-1",
         "model_ids": {"claude-sonnet-4-5": "global.anthropic.claude-sonnet-4-5-20250929-v1:0"}},
        {"name": "gg", "api": "gemini", "base_url": "http://x", "api_key_env": "KEY",
         "models": [FLASH]},
    ]}, env)
    kinds = {name: type(made(d, 10.0)) for name, d in defined.by_name.items()}
    assert kinds == {"oai": Upstream, "ant": Upstream, "az": AzureUpstream,
                     "br": BedrockUpstream, "gg": GeminiUpstream}
    assert client_of(defined.by_name["br"], 10.0) is client_of(defined.by_name["br"], 10.0)
