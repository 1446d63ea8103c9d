"""The stub's Azure OpenAI is the witness a gateway's Azure upstream is judged by: a deployment
is billed as the model /control maps it to, at the stub's own rates, exactly as the OpenAI
route it wraps bills that model; a call Azure refuses is unbilled.

Figures are worked by hand from infra/stub_prices.json (gpt-4o: $2.50 in, $10 out a million;
text-embedding-3-small: $0.02) and the stub's counting ("hello" as a chat message: 2 tokens for
its 5 bytes, 4 for the message, 3 for the reply). Calls go through the `openai` SDK: OpenAI with
the v1 base URL and the `api-key` header, as Microsoft documents the v1 API, and AzureOpenAI on
the dated routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from infra.stub_provider import StubProvider
from tests.infra.conftest import CALL_TIMEOUT_S, start_fresh
from tests.infra.test_stub_provider import bill_of, only_call

KEY = "azure-stub-key"
DEPLOYMENTS = {"prod-4o": "gpt-4o", "embed-small": "text-embedding-3-small"}
HELLO: Any = [{"role": "user", "content": "hello"}]
HELLO_TOKENS = 9
FORCED = {"X-Stub-Output-Tokens": "10"}
# 9 x $2.50 + 10 x $10 a million = 122.5 micro-dollars, rounded up once.
HELLO_COST_MICROS = 123


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=9, latency_ms_min=0, latency_ms_max=2, api_key=KEY) as stub:
        yield stub


@pytest.fixture(scope="module")
def v1(provider: StubProvider) -> openai.OpenAI:
    """Microsoft's way to the v1 API: the OpenAI client, the key as `api-key`."""
    return openai.OpenAI(base_url=f"{provider.url}/openai/v1", api_key="unused",
                         default_headers={"api-key": KEY}, max_retries=0,
                         timeout=CALL_TIMEOUT_S)


@pytest.fixture(scope="module")
def dated(provider: StubProvider) -> openai.AzureOpenAI:
    return openai.AzureOpenAI(azure_endpoint=provider.url, api_key=KEY,
                              api_version="2024-10-21", max_retries=0, timeout=CALL_TIMEOUT_S)


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"deployments": DEPLOYMENTS})


def test_v1_chat_bills_the_deployments_model(v1: openai.OpenAI, http: httpx.Client) -> None:
    answer = v1.chat.completions.create(model="prod-4o", messages=HELLO, extra_headers=FORCED)
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (HELLO_TOKENS, 10)
    assert answer.model == "gpt-4o"
    assert answer.model_extra is not None
    assert answer.model_extra["prompt_filter_results"][0]["prompt_index"] == 0
    assert answer.choices[0].model_extra is not None
    assert "content_filter_results" in answer.choices[0].model_extra
    call = only_call(http)
    assert (call.api, call.model, call.model_requested) == ("azure.chat.completions", "gpt-4o",
                                                            "prod-4o")
    assert call.cost_micros == HELLO_COST_MICROS


def test_v1_chat_streams(v1: openai.OpenAI, http: httpx.Client) -> None:
    stream = v1.chat.completions.create(model="prod-4o", messages=HELLO, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_headers=FORCED)
    chunks = list(stream)
    # Azure's first chunk: no choices, no model, only the prompt's content filtering.
    assert (chunks[0].choices, chunks[0].model) == ([], "")
    assert chunks[0].model_extra is not None
    assert "prompt_filter_results" in chunks[0].model_extra
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert [u.completion_tokens for u in usage] == [10]
    call = only_call(http)
    assert (call.stream, call.cost_micros) == (True, HELLO_COST_MICROS)


def test_azure_openai_on_the_dated_route(dated: openai.AzureOpenAI, http: httpx.Client) -> None:
    dated.chat.completions.create(model="prod-4o", messages=HELLO, extra_headers=FORCED)
    call = only_call(http)
    assert (call.model, call.model_requested, call.cost_micros) == ("gpt-4o", "prod-4o",
                                                                    HELLO_COST_MICROS)


def test_responses_bill_as_the_openai_route(v1: openai.OpenAI, dated: openai.AzureOpenAI,
                                           http: httpx.Client) -> None:
    via_v1 = v1.responses.create(model="prod-4o", input="hello", extra_headers=FORCED)
    via_dated = dated.responses.create(model="prod-4o", input="hello", extra_headers=FORCED)
    plain = http.post("/v1/responses", json={"model": "gpt-4o", "input": "hello"},
                      headers={"Authorization": f"Bearer {KEY}", **FORCED}).json()
    for answer in (via_v1, via_dated):
        assert answer.usage is not None
        assert answer.usage.input_tokens == plain["usage"]["input_tokens"]
        assert answer.usage.output_tokens == 10
    first, second, third = bill_of(http).log
    assert (first.api, first.model, first.model_requested) == ("azure.responses", "gpt-4o",
                                                               "prod-4o")
    # Input at $2.50 and 10 output tokens at $10 a million, rounded up once.
    tokens = plain["usage"]["input_tokens"]
    assert first.cost_micros == -(-(tokens * 250 + 10 * 1_000) // 100)
    assert first.cost_micros == second.cost_micros == third.cost_micros


def test_embeddings_through_azure(v1: openai.OpenAI, dated: openai.AzureOpenAI,
                                  http: httpx.Client) -> None:
    text = "x" * 4_000  # 1,000 tokens
    for client in (v1, dated):
        answer = client.embeddings.create(model="embed-small", input=text, dimensions=64)
        assert len(answer.data[0].embedding) == 64
        assert answer.usage.prompt_tokens == 1_000
    calls = bill_of(http).log
    assert [(c.api, c.model, c.model_requested) for c in calls] == [
        ("azure.embeddings", "text-embedding-3-small", "embed-small")] * 2
    # 1,000 x $0.02 a million.
    assert [c.cost_micros for c in calls] == [20, 20]


def test_an_unknown_deployment_is_not_found_unbilled(v1: openai.OpenAI, http: httpx.Client,
                                                     dated: openai.AzureOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as v1_missing:
        v1.chat.completions.create(model="gpt-4o", messages=HELLO)
    with pytest.raises(openai.NotFoundError) as dated_missing:
        dated.embeddings.create(model="nowhere", input="hi")
    for refused in (v1_missing, dated_missing):
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["code"] == "DeploymentNotFound"
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (2, 0)
    assert [c.model for c in bill.log] == ["gpt-4o", "nowhere"]


@pytest.mark.parametrize("headers", [{}, {"api-key": "wrong"}, {"Authorization": "Bearer no"}])
def test_a_wrong_or_missing_key_is_refused_unbilled(http: httpx.Client,
                                                    headers: dict[str, str]) -> None:
    answer = http.post("/openai/v1/chat/completions", headers=headers,
                       json={"model": "prod-4o", "messages": HELLO})
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "401"
    assert bill_of(http).total.calls == 0


def test_a_bearer_key_is_taken_too(provider: StubProvider, http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=f"{provider.url}/openai/v1", api_key=KEY, max_retries=0,
                           timeout=CALL_TIMEOUT_S)
    client.chat.completions.create(model="prod-4o", messages=HELLO, extra_headers=FORCED)
    assert only_call(http).cost_micros == HELLO_COST_MICROS


def test_the_dated_routes_need_an_api_version(http: httpx.Client) -> None:
    answer = http.post("/openai/deployments/prod-4o/chat/completions",
                       headers={"api-key": KEY}, json={"messages": HELLO})
    assert answer.status_code == 404
    served = http.post("/openai/deployments/prod-4o/chat/completions?api-version=2024-10-21",
                       headers={"api-key": KEY, **FORCED}, json={"messages": HELLO})
    assert served.status_code == 200
    assert [c.billed for c in bill_of(http).log] == [False, True]


def test_control_checks_and_shows_the_deployments(http: httpx.Client) -> None:
    refused = http.post("/control", json={"deployments": {"x": "no-such-model"}})
    assert refused.status_code == 400
    assert http.get("/control").json()["deployments"] == DEPLOYMENTS


def test_a_fault_answers_in_azures_shape(v1: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.RateLimitError):
        v1.chat.completions.create(model="prod-4o", messages=HELLO,
                                   extra_headers={"X-Stub-Fail-Status": "429"})
    assert bill_of(http).total.calls == 0
