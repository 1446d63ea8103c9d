"""Input a request only refers to, tried as a hostile key holder would.

The gateway holds what a Responses request only refers to (a stored prompt, a chain of stored
responses, reasoning sent back, a PDF, hosted web search with no bound given) at the model's
context window; the stub provider bills what OpenAI bills beyond the body (infra/
stub_responses.py: each referred token, each search and its content, a call past the window
refused unbilled, or cut to the window under `truncation: "auto"`). Each attack tries to be
billed more than it is held, and is judged by the stub's bill (tests/api/hostile.py judge):
every call billed at most its hold, the bill under the ceiling, the ledger equal to the bill.

gpt-5-mini: a 400,000-token window at $0.25 a million on both sides, so a call that refers to
anything is held $0.10 of input, plus its output cap at $2 a million.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill
from tests.api.conftest import Client, account, gateway, sdk
from tests.api.hostile import Attack, control, judge
from tests.infra.media import data_url, pdf
from tests.support import write_prices

pytestmark = pytest.mark.slow

MODEL = "gpt-5-mini"
WINDOW_TOKENS = 400_000
WINDOW_MICROS = WINDOW_TOKENS // 4  # $0.25 a million
DEFAULT_TIER = {"service_tier": "default"}
# A model of the operator's, priced in the prices file with no context window.
PRIVATE_MODEL = "hx-private"
# Far above any output cap here: every answer runs to its cap.
OUTPUT_TOKENS_MEAN = 1_000_000


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=34, latency_ms_min=0, latency_ms_max=2,
                      output_tokens_mean=OUTPUT_TOKENS_MEAN) as provider:
        yield provider


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, stub: StubProvider,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    prices = write_prices(tmp_path_factory, "refs", {"models": {PRIVATE_MODEL: {
        "input_usd_per_mtok": "1.00", "output_usd_per_mtok": "2.00"}}})
    with gateway(redis_server, prices, f"{stub.url}/v1", 30,
                 {"CEILING_EXPIRE_POLICY": "release"}) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_provider(stub: StubProvider) -> Iterator[None]:
    control(stub, files={}, prompts={}, prompt_cache=True, default_service_tier="default")
    reset_bill(stub.url)
    yield
    control(stub)


def responses(gw: ServiceProcess, key: str) -> Any:
    return sdk(gw, key).responses.with_raw_response.create


def test_a_stored_prompt_larger_than_any_body_is_held_at_the_window(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """Stored prompts of 390,000 tokens (inside the window) and of 2,000,000 (past it: refused
    unbilled, or cut to the window under truncation auto), behind a body of a few bytes."""
    ceiling = 5 * WINDOW_MICROS
    tag, key = account(admin, ceiling)
    control(stub, prompts={"pmpt_fits": {"tokens": 390_000}, "pmpt_huge": {"tokens": 2_000_000}})
    create = responses(gw, key)
    attack = Attack("responses: stored prompts of 390k and 2M tokens")
    for i in range(12):
        prompt = {"id": "pmpt_fits" if i % 3 == 0 else "pmpt_huge"}
        truncation = {"truncation": "auto"} if i % 3 == 1 else {}
        attack.send(create, model=MODEL, input="go", prompt=prompt, max_output_tokens=16,
                    **truncation, **DEFAULT_TIER)
    assert attack.refusals["budget_exceeded"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert verdict.bill.total.referenced_input_tokens >= 390_000


def test_a_chain_of_20_stored_responses_is_held_at_the_window_each(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """Each call continues the one before (previous_response_id), so the 20th reads what all 19
    before it read and wrote: billed as referred input, held at the window every time."""
    ceiling = 30 * WINDOW_MICROS
    tag, key = account(admin, ceiling)
    create = responses(gw, key)
    attack = Attack("responses: a chain of 20 previous_response_id")
    previous: dict[str, Any] = {}
    for _ in range(20):
        raw = attack.send(create, model=MODEL, input="and then? " * 200, max_output_tokens=500,
                          **previous, **DEFAULT_TIER)
        assert raw is not None
        if previous:
            assert int(raw.headers["x-ceiling-reserved-micros"]) > WINDOW_MICROS
        previous = {"previous_response_id": raw.parse().id}
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert verdict.provider_calls == 20
    assert verdict.bill.total.referenced_input_tokens > 19 * 500


def test_reasoning_sent_back_many_times_is_held_at_the_window(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """A reasoning item's encrypted content is billed as its reasoning tokens each time it is
    sent back, whatever its bytes: one long answer's reasoning, sent back 5 and 40 times in one
    input (past the window: refused unbilled, or cut to it under truncation auto)."""
    ceiling = 12 * WINDOW_MICROS
    tag, key = account(admin, ceiling)
    create = responses(gw, key)
    first = create(model=MODEL, input="think hard", max_output_tokens=20_000, store=False,
                   include=["reasoning.encrypted_content"], **DEFAULT_TIER).parse()
    reasoning = next(item.model_dump(exclude_none=True) for item in first.output
                     if item.type == "reasoning")
    assert reasoning["encrypted_content"]
    attack = Attack("responses: one reasoning item sent back 5 and 40 times")
    for i in range(10):
        copies = 5 if i % 2 else 40
        attack.send(create, model=MODEL, max_output_tokens=16, store=False,
                    input=[*([reasoning] * copies), {"role": "user", "content": "go on"}],
                    **({"truncation": "auto"} if i % 4 == 0 else {}), **DEFAULT_TIER)
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True)
    assert verdict.bill.total.referenced_input_tokens > 0


def test_a_pdf_of_many_pages_is_held_at_the_window(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """A PDF is billed its text and an image of each page, which its compressed bytes do not
    bound: 30 pages inline, 300 by file id (registered at 4 MB), and by URL."""
    ceiling = 6 * WINDOW_MICROS
    tag, key = account(admin, ceiling)
    control(stub, files={"file-book": {"bytes": 4_000_000, "pages": 300},
                         "https://docs.hostile.test/book.pdf": {"bytes": 200_000, "pages": 120}})
    create = responses(gw, key)
    files = [
        {"type": "input_file", "filename": "a.pdf", "file_data": data_url("application/pdf",
                                                                          pdf(30))},
        {"type": "input_file", "file_id": "file-book"},
        {"type": "input_file", "file_url": "https://docs.hostile.test/book.pdf"},
    ]
    attack = Attack("responses: PDFs inline, by file id and by URL")
    for i in range(12):
        attack.send(create, model=MODEL, max_output_tokens=16, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "summarize"}, files[i % len(files)]]}],
            **DEFAULT_TIER)
    judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)


def test_web_search_without_max_tool_calls_is_sent_with_the_gateways(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """The model would search 20 times a call if it may (/control web_searches): a call that
    gives no max_tool_calls is sent with the gateway's 2 and says so; each search is billed a
    fee and its content, every call under its hold."""
    # A call is held at 2 searches' fees and 3 windows (each step after a search reads at most
    # the window): the ceiling takes one such hold beside what the calls before it spent.
    ceiling = 4 * WINDOW_MICROS
    tag, key = account(admin, ceiling)
    control(stub, web_searches=20)
    create = responses(gw, key)
    attack = Attack("responses: hosted web search, max_tool_calls omitted")
    for i in range(12):
        raw = attack.send(create, model=MODEL, input="look it up", max_output_tokens=64,
                          tools=[{"type": "web_search"}], stream=i % 3 == 2, **DEFAULT_TIER)
        if raw is not None:
            assert raw.headers["x-ceiling-bounds-added"] == "max_tool_calls=2"
            if i % 3 == 2:
                list(raw.parse())
    assert attack.refusals["budget_exceeded"] + attack.refusals["budget_busy"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert verdict.bill.total.web_search_tool_calls == 2 * verdict.provider_calls > 0


def test_a_model_with_no_known_window_refuses_what_a_request_only_refers_to(
    gw: ServiceProcess, admin: Client, stub: StubProvider,
) -> None:
    """Named in the error: the field, and the setting that would bound it."""
    _, key = account(admin, 10 * WINDOW_MICROS)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        sdk(gw, key).responses.create(model=PRIVATE_MODEL, input="hi",
                                      previous_response_id="resp_1", max_output_tokens=16)
    assert (refused.value.code, refused.value.param) == ("input_unbounded",
                                                         "previous_response_id")
    assert "context_window_tokens" in refused.value.message
    assert fetch_bill(stub.url).requests == 0
