"""POST /v1/embeddings through a real gateway to the stub provider, which bills it from its own
table (infra/stub_embeddings.py): the hostile bodies first, each refused before the stub sees
anything; then a string, a list of strings and token arrays, each charged on the ledger what the
stub billed, to the micro-dollar; then the `openai` SDK's embeddings.create, unchanged.

Rates by hand: emb-one is one micro-dollar an input token in both tables (the gateway's prices
file, the stub's own); text-embedding-3-small is $0.02 a million, read by the gateway from the
bundled genai-prices and by the stub from its own table, each rounding a call up once. Neither
has an output rate: an embedding writes nothing, so nothing is held for output.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from core.formats.embeddings import EMBEDDING_INPUTS_MAX
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill
from tests.api.conftest import Client, account, as_key, gateway, header, ledger, sdk
from tests.support import write_prices

ROUTE = "/v1/embeddings"
# What a body's fields other than its input add to its hold: {"model": "emb-one"} as JSON
# (core/content.py json_bytes), one token a byte. A string input adds its quotes.
FRAMING = len(json.dumps({"model": "emb-one"}))
ONE = "emb-one"  # one micro-dollar an input token in both tables
SMALL = "text-embedding-3-small"  # $0.02 a million: the gateway's from genai-prices
UNPRICED = "emb-unpriced"  # in the stub's table only
# The key the gateway sends the stub, which refuses any other (401).
PROVIDER_KEY = "sk-stub-embeddings"
EMBEDDING = {"dimensions": 64, "dimensions_settable": True, "input_tokens_max": 8_192}
# A budget far above any call here, and one below the smallest call's hold.
ROOMY_MICROS = 10_000_000
TINY_MICROS = 5


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    # No output rate: a model with one would be refused the output cap of 0 an embedding holds.
    return write_prices(tmp_path_factory, "embeddings",
                        {"models": {ONE: {"input_usd_per_mtok": "1.00"}}})


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    # The stub's own table, merged into its default one (which has text-embedding-3-small).
    table = {"models": {
        ONE: {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "0", "embedding": EMBEDDING},
        UNPRICED: {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "0",
                   "embedding": EMBEDDING},
    }}
    with StubProvider(seed=37, latency_ms_min=0, latency_ms_max=2, prices=table,
                      api_key=PROVIDER_KEY) as provider:
        yield provider


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, prices_file: str, stub: StubProvider) -> Iterator[ServiceProcess]:
    with gateway(redis_server, prices_file, f"{stub.url}/v1", 30,
                 {"CEILING_UPSTREAM_API_KEY": PROVIDER_KEY}) as service:
        yield service


def call(admin: Client, key: str, body: object) -> httpx.Response:
    return admin.post(ROUTE, headers=as_key(key), json=body)


def billed_requests(stub: StubProvider) -> int:
    """Every request that reached the stub, billed or not."""
    return fetch_bill(stub.url, with_log=False).requests


def billed_micros(stub: StubProvider, model: str) -> int:
    tally = fetch_bill(stub.url, with_log=False).by_model.get(model)
    return 0 if tally is None else tally.cost_micros


def stub_tokens(text: str) -> int:
    """The stub's count of a string: its UTF-8 bytes over four, rounded up."""
    return -(-len(text.encode()) // 4)


# -- refused before the provider -----------------------------------------------------------------

HOSTILE: list[tuple[str, Any, str]] = [
    ("too many inputs", {"model": ONE, "input": ["x"] * (EMBEDDING_INPUTS_MAX + 1)}, "input"),
    ("a token id past any vocabulary", {"model": ONE, "input": [1, 2, 10**30]}, "input"),
    ("one in a list of token arrays", {"model": ONE, "input": [[1], [2, 200_100]]}, "input[1]"),
    ("a negative token", {"model": ONE, "input": [[-1]]}, "input[0]"),
    ("an unknown field", {"model": ONE, "input": "hi", "input_type": "query"}, "input_type"),
    ("a stream", {"model": ONE, "input": "hi", "stream": True}, "stream"),
    ("an output cap", {"model": ONE, "input": "hi", "max_tokens": 5}, "max_tokens"),
    ("an empty input", {"model": ONE, "input": []}, "input"),
    ("no model", {"input": "hi"}, "model"),
]


@pytest.mark.parametrize(("body", "field"), [(b, f) for _, b, f in HOSTILE],
                         ids=[why for why, _, _ in HOSTILE])
def test_a_hostile_body_is_refused_before_the_provider(admin: Client, stub: StubProvider,
                                                       body: Any, field: str) -> None:
    tag, key = account(admin, ROOMY_MICROS)
    before = billed_requests(stub)
    r = call(admin, key, body)
    assert r.status_code in (400, 422), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}  # OpenAI's shape
    assert error["param"] == field
    assert "x-ceiling-reservation-id" not in r.headers
    assert billed_requests(stub) == before
    period = ledger(admin, tag)
    assert (period["reserved_micros"], period["committed_micros"]) == (0, 0)


@pytest.mark.parametrize(("model", "code"), [(UNPRICED, "model_unpriced"),
                                             ("gpt-4o", "invalid_request")])
def test_a_model_the_prices_cannot_hold_is_refused_before_the_provider(
        admin: Client, stub: StubProvider, model: str, code: str) -> None:
    # emb-unpriced: no rate at all; gpt-4o: an output rate, so no embedding's hold of 0 output.
    tag, key = account(admin, ROOMY_MICROS)
    before = billed_requests(stub)
    r = call(admin, key, {"model": model, "input": "hi"})
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert error["code"] == code, error
    assert billed_requests(stub) == before
    period = ledger(admin, tag)
    assert (period["reserved_micros"], period["committed_micros"]) == (0, 0)


def test_a_budget_too_small_is_refused_402_and_the_provider_sees_nothing(
        admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, TINY_MICROS)
    before = billed_requests(stub)
    # Held at its bytes and framing: far above five micro-dollars at one a token.
    r = call(admin, key, {"model": ONE, "input": "x" * 400})
    assert r.status_code == 402, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)  # OpenAI's, and the budget's
    assert (error["code"], error["type"], error["ceiling_micros"]) == (
        "budget_exceeded", "budget_error", TINY_MICROS)
    # A clamp finds no output to lower: still refused.
    clamped = admin.post(ROUTE, headers={**as_key(key), "X-Ceiling-Clamp": "1"},
                         json={"model": ONE, "input": "x" * 400})
    assert clamped.status_code == 402, clamped.text
    assert billed_requests(stub) == before
    assert ledger(admin, tag)["committed_micros"] == 0


# -- charged what the provider billed ------------------------------------------------------------

INPUTS: list[tuple[str, Any, int]] = [
    ("a string", "héllo, world" * 37, stub_tokens("héllo, world" * 37)),
    ("a list of strings", ["a", "bb" * 50, "é" * 333], 1 + 25 + stub_tokens("é" * 333)),
    ("a token array", list(range(1, 900)), 899),
    ("token arrays", [[5] * 10, [200_099] * 7, [0]], 18),
    ("strings and token arrays", ["abcdefgh", [1, 2, 3]], 2 + 3),
]


@pytest.mark.parametrize("model", [ONE, SMALL])
@pytest.mark.parametrize(("given", "tokens"), [(g, t) for _, g, t in INPUTS],
                         ids=[why for why, _, _ in INPUTS])
def test_the_ledger_is_charged_the_providers_bill(admin: Client, stub: StubProvider,
                                                  model: str, given: Any, tokens: int) -> None:
    tag, key = account(admin, ROOMY_MICROS)
    before_requests, before_micros = billed_requests(stub), billed_micros(stub, model)
    r = call(admin, key, {"model": model, "input": given, "encoding_format": "float",
                          "user": "u-7"})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    inputs = 1 if isinstance(given, str) or isinstance(given[0], int) else len(given)
    assert [d["index"] for d in answer["data"]] == list(range(inputs))
    bill_micros = billed_micros(stub, model) - before_micros
    assert billed_requests(stub) == before_requests + 1
    assert bill_micros > 0
    assert header(r, "x-ceiling-charged-micros") == bill_micros
    assert r.headers["x-ceiling-billing-outcome"] == "billed"
    # Nothing was set for output: no cap was added, none clamped.
    assert "x-ceiling-bounds-added" not in r.headers
    assert "x-ceiling-clamped-output-tokens" not in r.headers
    assert header(r, "x-ceiling-reserved-micros") >= bill_micros
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (bill_micros, 0)
    if model == ONE:
        assert bill_micros == tokens  # one micro-dollar a token, by hand


def test_its_input_is_held_by_its_bytes_and_no_output(admin: Client) -> None:
    # One micro-dollar a token: the hold is the input's JSON bytes and the body's other fields'
    # (core/formats/embeddings.py), and nothing for output.
    tag, key = account(admin, ROOMY_MICROS)
    body = {"model": ONE, "input": "x" * 1_000}
    r = call(admin, key, body)
    assert r.status_code == 200, r.text
    assert header(r, "x-ceiling-reserved-micros") == 2 + 1_000 + FRAMING
    assert header(r, "x-ceiling-charged-micros") == 250  # the stub's 1,000 bytes over four
    assert ledger(admin, tag)["committed_micros"] == 250


def test_a_budget_that_fits_the_input_exactly_is_enough(admin: Client,
                                                        stub: StubProvider) -> None:
    # No output is held: a budget of just the input's hold admits the call.
    hold_micros = 2 + 400 + FRAMING
    tag, key = account(admin, hold_micros)
    r = call(admin, key, {"model": ONE, "input": "x" * 400})
    assert r.status_code == 200, r.text
    assert header(r, "x-ceiling-reserved-micros") == hold_micros
    assert ledger(admin, tag)["committed_micros"] == 100
    refused = call(admin, account(admin, hold_micros - 1)[1],
                   {"model": ONE, "input": "x" * 400})
    assert refused.status_code == 402, refused.text


def test_the_provider_refusing_a_call_releases_its_hold(admin: Client,
                                                        stub: StubProvider) -> None:
    # 8,193 tokens by the stub's count, above the model's 8,192 a input: the gateway's hold
    # admits it (its bytes), the provider refuses it unbilled, and the hold is released.
    tag, key = account(admin, ROOMY_MICROS)
    before = billed_micros(stub, ONE)
    r = call(admin, key, {"model": ONE, "input": "x" * 32_769})
    assert r.status_code == 400, r.text
    assert r.headers["x-ceiling-billing-outcome"] == "released"
    assert billed_micros(stub, ONE) == before
    period = ledger(admin, tag)
    assert (period["committed_micros"], period["reserved_micros"]) == (0, 0)


# -- the openai SDK, unchanged -------------------------------------------------------------------


@pytest.mark.parametrize("model", [ONE, SMALL])
def test_the_openai_sdk_works_unchanged(gw: ServiceProcess, admin: Client, stub: StubProvider,
                                        model: str) -> None:
    tag, key = account(admin, ROOMY_MICROS)
    before = billed_micros(stub, model)
    client = sdk(gw, key)
    text = f"the sdk's own call {uuid.uuid4().hex}"
    # The SDK asks for base64 vectors by default and decodes them.
    answer = client.embeddings.create(model=model, input=[text, text], dimensions=32)
    assert [len(e.embedding) for e in answer.data] == [32, 32]
    assert answer.usage.prompt_tokens == 2 * stub_tokens(text)
    raw = client.embeddings.with_raw_response.create(model=model, input=[7, 8, 9])
    assert raw.parse().usage.prompt_tokens == 3
    assert raw.headers["x-ceiling-billing-outcome"] == "billed"
    bill_micros = billed_micros(stub, model) - before
    assert ledger(admin, tag)["committed_micros"] == bill_micros > 0
    with pytest.raises(openai.APIStatusError) as refused:
        sdk(gw, account(admin, TINY_MICROS)[1]).embeddings.create(model=ONE, input="x" * 400)
    assert (refused.value.status_code, refused.value.code) == (402, "budget_exceeded")


def test_a_base64_answer_is_relayed_byte_for_byte(admin: Client) -> None:
    _, key = account(admin, ROOMY_MICROS)
    r = call(admin, key, {"model": ONE, "input": "hi", "dimensions": 4,
                          "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    # Four little-endian float32s: what the stub encoded, unchanged by the gateway.
    assert len(base64.b64decode(r.json()["data"][0]["embedding"])) == 16


def test_a_retry_with_its_idempotency_key_is_replayed_not_called_again(
        admin: Client, stub: StubProvider) -> None:
    tag, key = account(admin, ROOMY_MICROS)
    before = billed_requests(stub)
    headers = {**as_key(key), "Idempotency-Key": uuid.uuid4().hex}
    body = {"model": ONE, "input": ["one", "two"]}
    first = admin.post(ROUTE, headers=headers, json=body)
    again = admin.post(ROUTE, headers=headers, json=body)
    assert (first.status_code, again.status_code) == (200, 200), again.text
    assert again.headers["x-ceiling-replayed"] == "true"
    assert again.json() == first.json()
    assert billed_requests(stub) == before + 1
    assert ledger(admin, tag)["committed_micros"] == header(first, "x-ceiling-charged-micros") == 2
