"""The stub's embeddings route is the witness a gateway's POST /v1/embeddings is judged by: input
tokens only, at the embedding model's rate from the stub's own table, by its own counting.

Every figure is worked by hand: a string's UTF-8 bytes over four, rounded up, with no message
framing; a token array its length; rates per million tokens from infra/stub_prices.json
(text-embedding-3-small $0.02, -3-large $0.13, ada-002 $0.10). Calls go through the `openai`
SDK (which asks for base64 vectors by default) and raw httpx.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from infra.stub_provider import StubProvider
from tests.infra.conftest import start_fresh
from tests.infra.test_stub_provider import bill_of, only_call

EMBEDDINGS = "/v1/embeddings"
# 4,000 bytes: 1,000 tokens.
THOUSAND = "x" * 4_000


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=3, latency_ms_min=0, latency_ms_max=2) as stub:
        yield stub


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {})


@pytest.mark.parametrize(("model", "dimensions", "cost_micros"), [
    ("text-embedding-3-small", 1_536, 2 * 1_000 * 2 // 100),  # 2,000 x $0.02 a million
    ("text-embedding-3-large", 3_072, 2 * 1_000 * 13 // 100),  # 2,000 x $0.13
    ("text-embedding-ada-002", 1_536, 2 * 1_000 * 10 // 100),  # 2,000 x $0.10
])
def test_the_sdk_is_billed_input_tokens_only(sdk: openai.OpenAI, http: httpx.Client, model: str,
                                             dimensions: int, cost_micros: int) -> None:
    answer = sdk.embeddings.create(model=model, input=[THOUSAND, THOUSAND])
    assert [len(e.embedding) for e in answer.data] == [dimensions, dimensions]
    assert [e.index for e in answer.data] == [0, 1]
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (2_000, 2_000)
    call = only_call(http)
    assert (call.api, call.model, call.stream) == ("embeddings", model, False)
    assert call.usage is not None
    assert (call.usage.input_tokens, call.usage.output_tokens) == (2_000, 0)
    assert call.cost_micros == cost_micros


def test_each_string_is_counted_alone_and_rounded_up(sdk: openai.OpenAI,
                                                     http: httpx.Client) -> None:
    # "hello": 5 bytes -> 2 tokens; "hello world": 11 bytes -> 3; "é": 2 bytes -> 1.
    answer = sdk.embeddings.create(model="text-embedding-3-large",
                                   input=["hello", "hello world", "é"])
    assert answer.usage.prompt_tokens == 6
    # 6 x $0.13 a million = 0.78 micro-dollars, rounded up once.
    assert only_call(http).cost_micros == 1


def test_token_arrays_count_their_length(http: httpx.Client) -> None:
    many = http.post(EMBEDDINGS, json={"model": "text-embedding-3-small",
                                       "input": [[1, 2, 3], [4, 5]]}).json()
    one = http.post(EMBEDDINGS, json={"model": "text-embedding-3-small",
                                      "input": [7, 8, 9, 10]}).json()
    assert (len(many["data"]), many["usage"]["prompt_tokens"]) == (2, 5)
    assert (len(one["data"]), one["usage"]["prompt_tokens"]) == (1, 4)


def test_dimensions_and_float_encoding(http: httpx.Client) -> None:
    answer = http.post(EMBEDDINGS, json={"model": "text-embedding-3-small", "input": "hi",
                                         "dimensions": 256, "encoding_format": "float"}).json()
    vector = answer["data"][0]["embedding"]
    assert len(vector) == 256
    assert all(isinstance(v, float) for v in vector)
    assert answer["model"] == "text-embedding-3-small"
    assert answer["object"] == "list"


@pytest.mark.parametrize(("doc", "status"), [
    ({"model": "text-embedding-ada-002", "input": "hi", "dimensions": 256}, 400),
    ({"model": "text-embedding-3-small", "input": "hi", "dimensions": 1_537}, 400),
    ({"model": "text-embedding-3-small", "input": ""}, 400),
    ({"model": "text-embedding-3-small", "input": []}, 400),
    ({"model": "text-embedding-3-small", "input": ["ok", ""]}, 400),
    ({"model": "text-embedding-3-small", "input": ["x"] * 2_049}, 400),
    # 32,769 bytes: 8,193 tokens, one above the model's 8,192.
    ({"model": "text-embedding-3-small", "input": "x" * 32_769}, 400),
    ({"model": "text-embedding-3-small", "input": "hi", "encoding_format": "int8"}, 400),
    ({"model": "text-embedding-3-small", "input": "hi", "stream": True}, 400),
    ({"model": "gpt-4o", "input": "hi"}, 400),
    ({"model": "text-embedding-9", "input": "hi"}, 404),
    ({"input": "hi"}, 400),
])
def test_a_bad_call_is_refused_unbilled(http: httpx.Client, doc: dict[str, Any],
                                        status: int) -> None:
    answer = http.post(EMBEDDINGS, json=doc)
    assert answer.status_code == status
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (1, 0)


def test_the_largest_input_is_served(http: httpx.Client) -> None:
    answer = http.post(EMBEDDINGS, json={"model": "text-embedding-3-small",
                                         "input": "x" * 32_768})
    assert answer.json()["usage"]["prompt_tokens"] == 8_192


def test_an_embedding_model_is_not_a_chat_model(sdk: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="text-embedding-3-small",
                                    messages=[{"role": "user", "content": "hi"}])
    assert bill_of(http).total.calls == 0


def test_a_call_failed_after_billing_is_billed(http: httpx.Client) -> None:
    answer = http.post(EMBEDDINGS, json={"model": "text-embedding-3-small", "input": THOUSAND},
                       headers={"X-Stub-Fail-After-Billing": "500"})
    assert answer.status_code == 500
    call = only_call(http)
    assert (call.billed, call.status, call.cost_micros) == (True, 500, 20)
