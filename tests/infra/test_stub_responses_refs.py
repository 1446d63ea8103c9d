"""The stub bills what OpenAI bills beyond a Responses body: reasoning sent back, stored items,
previous responses, conversations, stored prompts, files by id and hosted web searches, each
held to the model's context window. Every figure is worked by hand from the stub's documented
rules (infra/stub_tokens.py: ceil(bytes / 4) a text, 4 a message or item, 3 the reply) and the
prices cited in infra/stub_prices.json; calls go through the real `openai` SDK.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import httpx
import openai
import pytest

from infra.stub_bill import Bill, CallRecord, Usage
from infra.stub_provider import StubProvider
from tests.infra.conftest import start_fresh

# "hello" as the whole input: 2 tokens of text, 4 for the item, 3 for the reply.
HELLO_TOKENS = 9
# A reasoning model with a small window, to reach it cheaply (the stub's own table format).
TABLE = {"models": {
    "stub-window": {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "4.00",
                    "reasoning": True, "context_window_tokens": 1_000},
}}
# OpenAI's web search: $10 per 1,000 calls (developers.openai.com/api/docs/pricing, built-in
# tools); the preview on a model that does not reason, $25 per 1,000.
SEARCH_FEE_MICROS = 10_000
PREVIEW_FEE_MICROS = 25_000
# The stub's search content a search, unless the model bills a fixed block (its default
# `web_search_result_tokens`).
SEARCH_CONTENT_TOKENS = 8_000


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=11, latency_ms_min=0, latency_ms_max=2, prices=TABLE) as stub:
        yield stub


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"files": {}, "prompts": {}, "tool_calls": [],
                       "prompt_cache": False})


def log(http: httpx.Client) -> list[CallRecord]:
    return list(Bill.from_json(http.get("/billing").json()).log)


def usage_of(call: CallRecord) -> Usage:
    assert call.usage is not None
    return call.usage


def forced(output: int, reasoning: int | None = None) -> dict[str, str]:
    headers = {"X-Stub-Output-Tokens": str(output)}
    if reasoning is not None:
        headers["X-Stub-Reasoning-Tokens"] = str(reasoning)
    return headers


def refused(sdk_call: Any, status: int, code: str | None = None) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        sdk_call()
    assert caught.value.status_code == status
    if code is not None:
        assert caught.value.code == code
    return caught.value


# -- reasoning ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt-5", "gpt-5-mini", "gpt-5.1-codex", "o4-mini"])
def test_a_reasoning_model_answers_with_a_reasoning_item_first(sdk: openai.OpenAI,
                                                               model: str) -> None:
    response = sdk.responses.create(
        model=model, input="hello", reasoning={"effort": "low", "summary": "auto"},
        include=["reasoning.encrypted_content"], max_output_tokens=200,
        extra_headers=forced(40, 20))
    reasoning, message = response.output
    assert reasoning.type == "reasoning"
    assert message.type == "message"
    assert reasoning.id.startswith("rs_")
    assert reasoning.encrypted_content
    assert reasoning.summary
    assert reasoning.summary[0].type == "summary_text"
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == 20


@pytest.mark.parametrize("store", [True, False])
def test_reasoning_sent_back_is_billed_as_input(
    sdk: openai.OpenAI, http: httpx.Client, store: bool
) -> None:
    first = sdk.responses.create(model="gpt-5", input="hello", store=store,
                                 include=["reasoning.encrypted_content"],
                                 extra_headers=forced(50, 30))
    reasoning = first.output[0].model_dump(exclude_none=True)
    second = sdk.responses.create(
        model="gpt-5", store=store, extra_headers=forced(5),
        input=[{"role": "user", "content": "hello"}, reasoning])  # type: ignore[list-item]
    assert second.usage is not None
    # "hello" 2 + 4, the reasoning item's 30 tokens + 4, the reply's 3.
    assert second.usage.input_tokens == 6 + 34 + 3
    assert usage_of(log(http)[-1]).referenced_input_tokens == 30


def test_reasoning_content_the_stub_did_not_issue_is_refused_unbilled(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    first = sdk.responses.create(model="gpt-5", input="hello", store=False,
                                 extra_headers=forced(50, 30))
    genuine = first.output[0].model_dump(exclude_none=True)
    assert isinstance(genuine["encrypted_content"], str)
    tampered = genuine["encrypted_content"][:-4] + ("AAAA" if not genuine[
        "encrypted_content"].endswith("AAAA") else "BBBB")
    for content in ("gAAAAAforged", tampered, "not base64 at all"):
        item = {**genuine, "encrypted_content": content}
        refused(lambda item=item: sdk.responses.create(
            model="gpt-5", input=[item], store=False), 400, "invalid_encrypted_content")
    assert [(c.status, c.billed) for c in log(http)][1:] == [(400, False)] * 3


def test_items_of_a_stored_response_are_billed_by_id_and_by_reference(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    first = sdk.responses.create(model="gpt-5", input="hello", extra_headers=forced(50, 30))
    rs_id, msg_id = first.output[0].id, first.output[1].id
    reasoning_by_id: Any = [{"type": "reasoning", "id": rs_id, "summary": []}]
    references: Any = [{"type": "item_reference", "id": rs_id},
                       {"type": "item_reference", "id": msg_id}]
    by_id = sdk.responses.create(model="gpt-5", extra_headers=forced(5), input=reasoning_by_id)
    by_reference = sdk.responses.create(model="gpt-5", extra_headers=forced(5),
                                        input=references)
    assert by_id.usage is not None
    assert by_reference.usage is not None
    assert by_id.usage.input_tokens == 30 + 4 + 3
    # The message: its 20 words, one token each as the stub counts them, and 4 for the item.
    text_tokens = math.ceil(len(first.output_text.encode()) / 4)
    assert by_reference.usage.input_tokens == (30 + 4) + (text_tokens + 4 + 4) + 3
    # Not stored: nothing to refer to.
    unstored = sdk.responses.create(model="gpt-5", input="hello", store=False,
                                    extra_headers=forced(50, 30))
    dangling: Any = [{"type": "item_reference", "id": unstored.output[0].id}]
    refused(lambda: sdk.responses.create(model="gpt-5", input=dangling), 400)
    assert not log(http)[-1].billed


# -- previous responses, conversations, stored prompts, files ----------------------------------


def test_a_chain_of_twenty_previous_responses_bills_all_it_holds(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    previous = None
    for n in range(1, 21):
        response = sdk.responses.create(model="gpt-4o", input="hello",
                                        previous_response_id=previous, extra_headers=forced(10))
        assert response.usage is not None
        # Each stored response holds its input and its 10 tokens out: 19 more a link.
        assert response.usage.input_tokens == 19 * (n - 1) + HELLO_TOKENS
        previous = response.id
    assert usage_of(log(http)[-1]).referenced_input_tokens == 19 * 19


def test_input_above_the_context_window_is_refused_unless_truncated(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    # 5,000 bytes of a file by id: 1,250 tokens, above stub-window's 1,000.
    http.post("/control", json={"files": {"file-big": {"bytes": 5_000}}}).raise_for_status()
    items: Any = [{"role": "user", "content": [
        {"type": "input_text", "text": "hello"}, {"type": "input_file", "file_id": "file-big"}]}]
    refused(lambda: sdk.responses.create(model="stub-window", input=items), 400,
            "context_length_exceeded")
    assert not log(http)[-1].billed
    fitted = sdk.responses.create(model="stub-window", input=items, truncation="auto",
                                  extra_headers=forced(5))
    assert fitted.usage is not None
    assert fitted.usage.input_tokens == 1_000
    usage = usage_of(log(http)[-1])
    # What was dropped is what the body only referred to: "hello" 2 + 4, the reply 3 and the
    # file's 1,250 make 1,259, 259 too many.
    assert usage.referenced_input_tokens == 1_250 - 259
    assert log(http)[-1].cost_micros == 1_000 + 4 * 5


def test_a_chain_past_the_window_is_held_to_it_when_truncated(sdk: openai.OpenAI) -> None:
    previous = None
    for _ in range(12):
        response = sdk.responses.create(model="stub-window", input="hello" * 20,
                                        previous_response_id=previous, truncation="auto",
                                        extra_headers=forced(100, 50))
        assert response.usage is not None
        assert response.usage.input_tokens <= 1_000
        previous = response.id
    assert response.usage is not None
    assert response.usage.input_tokens == 1_000


def test_a_conversation_is_read_as_input_and_grows_with_each_call(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    conversation = sdk.conversations.create(items=[
        {"type": "message", "role": "user", "content": "hello"}])
    assert conversation.id.startswith("conv_")
    first = sdk.responses.create(model="gpt-4o", conversation=conversation.id, input="hello",
                                 extra_headers=forced(8))
    assert first.usage is not None
    assert first.usage.input_tokens == 6 + 6 + 3
    assert usage_of(log(http)[-1]).referenced_input_tokens == 6
    second = sdk.responses.create(model="gpt-4o", conversation={"id": conversation.id},
                                  input="hello", extra_headers=forced(8))
    assert second.usage is not None
    # The first item, the first call's input and its answer (8 words: 39 bytes, 10 + 4).
    answer_tokens = math.ceil(len(first.output_text.encode()) / 4) + 4
    assert second.usage.input_tokens == 6 + 6 + answer_tokens + 6 + 3
    sdk.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "hello"}])
    third = sdk.responses.create(model="gpt-4o", conversation=conversation.id, input="hello",
                                 extra_headers=forced(8))
    assert third.usage is not None
    assert third.usage.input_tokens == second.usage.input_tokens + 6 + answer_tokens + 6
    refused(lambda: sdk.responses.create(model="gpt-4o", conversation="conv_nope",
                                         input="hello"), 400)


def test_a_stored_prompt_is_billed_as_input(sdk: openai.OpenAI, http: httpx.Client) -> None:
    http.post("/control", json={"prompts": {"pmpt_1": {"tokens": 500}}}).raise_for_status()
    response = sdk.responses.create(model="gpt-4o", input="hello", extra_headers=forced(5),
                                    prompt={"id": "pmpt_1", "version": "2",
                                            "variables": {"city": "Paris"}})
    assert response.usage is not None
    # 500, "Paris" 2 + 4, "hello" 2 + 4, the reply 3.
    assert response.usage.input_tokens == 500 + 6 + 6 + 3
    assert usage_of(log(http)[-1]).referenced_input_tokens == 500
    refused(lambda: sdk.responses.create(model="gpt-4o", input="hello",
                                         prompt={"id": "pmpt_unknown"}), 400)


def test_files_by_id_are_billed_as_text_and_a_page_image_each(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    http.post("/control", json={"files": {"file-pdf": {"bytes": 400, "pages": 3}}}
              ).raise_for_status()
    # 400 bytes: 100 tokens; a page of 1224 x 1584 at gpt-4o's high detail: 85 + 170 x 4 tiles
    # (scaled to 768 x 993.9: 2 x 2 tiles) = 765, three pages.
    file_tokens = 100 + 3 * 765
    items: Any = [{"role": "user", "content": [{"type": "input_file", "file_id": "file-pdf"}]}]
    response = sdk.responses.create(model="gpt-4o", input=items, extra_headers=forced(5))
    assert response.usage is not None
    assert response.usage.input_tokens == file_tokens + 4 + 3
    chat = sdk.chat.completions.create(model="gpt-4o", extra_headers=forced(5), messages=[
        {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-pdf"}}]}])
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == file_tokens + 4 + 3
    assert [usage_of(c).referenced_input_tokens for c in log(http)] == [file_tokens] * 2


# -- hosted web search -------------------------------------------------------------------------


def token_micros(call: CallRecord, input_rate: str, output_rate: str) -> int:
    usage = usage_of(call)
    return math.ceil(usage.input_tokens * Fraction(input_rate)
                     + usage.output_tokens * Fraction(output_rate))


def test_web_search_bills_a_fee_a_search_and_its_content_as_input(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    response = sdk.responses.create(
        model="gpt-5", input="hello", tools=[{"type": "web_search"}], max_tool_calls=2,
        include=["web_search_call.action.sources"],
        extra_headers={**forced(10, 5), "X-Stub-Web-Searches": "3"})
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "web_search_call", "web_search_call", "message"]
    search = response.output[1]
    assert search.type == "web_search_call"
    assert search.action.type == "search"
    assert search.action.sources
    assert response.usage is not None
    # At most max_tool_calls: 2 searches of 8,000 tokens of content each, on top of the input
    # and the tool's definition ('[{"type":"web_search"}]', 23 bytes: 6 tokens).
    assert response.usage.input_tokens == 2 * SEARCH_CONTENT_TOKENS + HELLO_TOKENS + 6
    call = log(http)[-1]
    usage = usage_of(call)
    assert (usage.web_search_tool_calls, usage.web_search_content_tokens) == (2, 16_000)
    # gpt-5: $1.25 in, $10 out (developers.openai.com/api/docs/pricing).
    assert call.cost_micros == token_micros(call, "1.25", "10.00") + 2 * SEARCH_FEE_MICROS


@pytest.mark.parametrize(("model", "tool", "content", "fee", "preview"), [
    # gpt-4o-mini's web search: a fixed block of 8,000 tokens a search, whatever the setting.
    ("gpt-4o-mini", "web_search", 8_000, SEARCH_FEE_MICROS, False),
    # The preview on a model that does not reason: the dearer fee, its content free.
    ("gpt-4o", "web_search_preview", 0, PREVIEW_FEE_MICROS, True),
    # ...and on one that reasons, the web search's own terms.
    ("o4-mini", "web_search_preview", 2_000, SEARCH_FEE_MICROS, False),
])
def test_each_kind_of_web_search_is_billed_by_its_rule(
    sdk: openai.OpenAI, http: httpx.Client, model: str, tool: str, content: int, fee: int,
    preview: bool,
) -> None:
    http.post("/control", json={"web_search_result_tokens": 2_000}).raise_for_status()
    try:
        tools: Any = [{"type": tool}]
        sdk.responses.create(model=model, input="hello", tools=tools, extra_headers=forced(10))
    finally:
        http.post("/control", json={"web_search_result_tokens": SEARCH_CONTENT_TOKENS})
    usage = usage_of(log(http)[-1])
    assert usage.web_search_content_tokens == content
    assert (usage.web_search_preview_calls, usage.web_search_tool_calls) == (
        (1, 0) if preview else (0, 1))
    rates = {"gpt-4o-mini": ("0.15", "0.60"), "gpt-4o": ("2.50", "10.00"),
             "o4-mini": ("1.10", "4.40")}[model]
    assert log(http)[-1].cost_micros == token_micros(log(http)[-1], *rates) + fee


def test_without_max_tool_calls_a_hostile_control_runs_many_searches(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    http.post("/control", json={"web_searches": 20, "calls": 1}).raise_for_status()
    events = list(sdk.responses.create(model="gpt-5", input="hello", stream=True,
                                       tools=[{"type": "web_search"}], extra_headers=forced(10)))
    usage = usage_of(log(http)[-1])
    assert (usage.web_search_tool_calls, usage.web_search_content_tokens) == (20, 160_000)
    kinds = [e.type for e in events]
    assert kinds.count("response.web_search_call.searching") == 20
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done.count("web_search_call") == 20
    # Search content is held to the window too: stub-window's 1,000 less the input.
    sdk.responses.create(model="stub-window", input="hello", tools=[{"type": "web_search"}],
                         extra_headers={**forced(10), "X-Stub-Web-Searches": "5"})
    assert usage_of(log(http)[-1]).input_tokens == 1_000


def test_the_conversations_routes_answer_as_openais_do(sdk: openai.OpenAI,
                                                        http: httpx.Client) -> None:
    conversation = sdk.conversations.create(metadata={"topic": "x"})
    assert sdk.conversations.retrieve(conversation.id).id == conversation.id
    added = sdk.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "hello"}])
    assert [item.type for item in added.data] == ["message"]
    assert [item.id for item in sdk.conversations.items.list(conversation.id)] == [
        added.data[0].id]
    refused(lambda: sdk.conversations.retrieve("conv_nope"), 404)
    refused(lambda: sdk.conversations.items.create("conv_nope", items=[]), 404)
    # At most 20 items a call, as OpenAI takes them.
    too_many: Any = [{"type": "message", "role": "user", "content": "hi"}] * 21
    refused(lambda: sdk.conversations.create(items=too_many), 400)
    # A conversation with previous_response_id: refused, unbilled.
    first = sdk.responses.create(model="gpt-4o", input="hello", extra_headers=forced(5))
    refused(lambda: sdk.responses.create(model="gpt-4o", input="hello",
                                         conversation=conversation.id,
                                         previous_response_id=first.id), 400)
    assert [c.billed for c in log(http)] == [True, False]


@pytest.mark.parametrize(("file_bytes", "rates"), [
    # 200,000 tokens of file: below 272,000, gpt-6.2-sol's $2 in and $10 out.
    (800_000, ("2.00", "10.00")),
    # 300,000: above it, the whole call at the long-context rates, $4 in and $15 out.
    (1_200_000, ("4.00", "15.00")),
])
def test_a_call_above_openais_long_context_threshold_is_billed_whole_at_its_rates(
    sdk: openai.OpenAI, http: httpx.Client, file_bytes: int, rates: tuple[str, str]
) -> None:
    http.post("/control", json={"files": {"file-long": {"bytes": file_bytes}}}
              ).raise_for_status()
    items: Any = [{"role": "user", "content": [{"type": "input_file", "file_id": "file-long"}]}]
    response = sdk.responses.create(model="gpt-6.2-sol", input=items, extra_headers=forced(10))
    assert response.service_tier == "default"
    call = log(http)[-1]
    assert usage_of(call).input_tokens == file_bytes // 4 + 4 + 3
    assert call.cost_micros == token_micros(call, *rates)
