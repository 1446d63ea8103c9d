"""The gateway's parts without servers: pricing a request, reading a stream, idempotency state.

What the end-to-end tests (test_gateway.py) cannot reach through the stub provider is proved
here: the Responses API's shapes, streams split at every byte, cumulative usage, providers
that report no usage.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.responses import Response
from starlette.types import Message

from api.refusals import Shapes
from api.routes.gateway import answered
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.config import OUTPUT_TOKENS_DEFAULT
from core.content import Media
from core.errors import (
    FieldUnsupported,
    IdempotencyConflict,
    InputUnbounded,
    InvalidRequest,
    StateQuota,
)
from core.formats import FORMATS, Api, StreamTally
from core.formats.responses import responses_input
from core.gateway import Bill, Call, Outcome, OutputLengths, hold, kept_while_sent
from core.gateway_request import body_outcome, plan, usage_of
from core.jsonbody import JSON_DEPTH_MAX
from core.ledger import GATEWAY_OWNER_PREFIX, ClaimKind, Kept, ReplyRef, ReplyStore, StoredReply
from core.limits import REPLIES_PER_KEY_MAX, REPLY_BYTES_PER_KEY_MAX
from core.prices import PriceTable, Usage
from core.replies import (
    IN_FLIGHT_RETRY_AFTER_S,
    IN_FLIGHT_WAIT_S_MAX,
    REPLY_STORED_BYTES_MAX,
    IdempotencyInFlight,
    Ticket,
    claim,
    packed,
    unpacked,
)
from core.service import CeilingService
from core.stores.memory import MemoryReplies, MemoryStore
from core.stores.redis import RedisTransport, redis_client
from core.stores.scripted import ScriptedReplies
from infra.redis_server import RedisServer
from tests.estimate import input_tokens_upper_bound
from tests.support import ManualClock

MESSAGES = [{"role": "user", "content": "hello"}]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "gpt-4o", "messages": MESSAGES, **fields}).encode()


# -- pricing a request --------------------------------------------------------------------------


def test_the_cap_is_the_callers_or_the_default_which_is_forwarded() -> None:
    assert plan(Api.CHAT, body(max_tokens=50)).output_tokens_max == 50
    assert plan(Api.CHAT, body(max_completion_tokens=60)).output_tokens_max == 60
    assert plan(Api.CHAT, body(max_tokens=70, max_completion_tokens=70)).output_tokens_max == 70
    defaulted = plan(Api.CHAT, body())
    assert defaulted.output_tokens_max == OUTPUT_TOKENS_DEFAULT
    assert json.loads(defaulted.content())["max_completion_tokens"] == OUTPUT_TOKENS_DEFAULT
    responses = plan(Api.RESPONSES, json.dumps({"model": "gpt-4o", "input": "hi"}).encode())
    assert json.loads(responses.content())["max_output_tokens"] == OUTPUT_TOKENS_DEFAULT


def test_n_multiplies_the_output_and_the_input_is_bounded_by_the_forwarded_bytes() -> None:
    p = plan(Api.CHAT, body(max_tokens=10, n=3))
    assert (p.choices, p.spec().choices) == (3, 3)
    rest = {k: v for k, v in json.loads(p.content()).items() if k != "messages"}
    assert p.text_tokens_max == input_tokens_upper_bound(MESSAGES) + len(
        json.dumps(rest).encode())
    # Two requests that forward the same body are priced the same.
    assert plan(Api.CHAT, body()).text_tokens_max == plan(
        Api.CHAT, body(max_completion_tokens=OUTPUT_TOKENS_DEFAULT)).text_tokens_max


def test_a_chat_stream_asks_for_usage_and_remembers_whether_the_client_did() -> None:
    quiet = plan(Api.CHAT, body(stream=True, stream_options={"include_obfuscation": False}))
    assert json.loads(quiet.content())["stream_options"] == {
        "include_obfuscation": False, "include_usage": True}
    assert not quiet.usage_wanted
    assert plan(Api.CHAT, body(stream=True, stream_options={"include_usage": True})).usage_wanted


@pytest.mark.parametrize(("api", "fields", "param"), [
    (Api.CHAT, {"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    (Api.CHAT, {"max_tokens": 0}, "max_tokens"),
    (Api.CHAT, {"max_tokens": True}, "max_tokens"),
    (Api.CHAT, {"n": 0}, "n"),
    (Api.CHAT, {"audio": {"voice": "alloy"}}, "audio"),
    (Api.CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (Api.CHAT, {"modalities": "audio"}, "modalities"),
    (Api.CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (Api.CHAT, {"speed": "fast"}, "speed"),
    (Api.CHAT, {"service_tier": 1}, "service_tier"),
    (Api.CHAT, {"messages": "hello"}, "messages"),
    (Api.CHAT, {"model": 7}, "model"),
    (Api.RESPONSES, {"background": True}, "background"),
    (Api.RESPONSES, {"input": 7}, "input"),
])
def test_what_cannot_be_priced_is_refused(api: Api, fields: dict[str, Any], param: str) -> None:
    doc = {"model": "gpt-4o", "messages": MESSAGES} if api is Api.CHAT else {
        "model": "gpt-4o", "input": "hi"}
    with pytest.raises(InvalidRequest) as refused:
        plan(api, json.dumps({**doc, **fields}).encode())
    assert refused.value.details.get("field") == param
    assert not isinstance(refused.value, InputUnbounded)


@pytest.mark.parametrize("api", [Api.CHAT, Api.RESPONSES, Api.MESSAGES])
@pytest.mark.parametrize("field", [
    "plugins",  # a router's web plugin, billed per result
    "models",  # a router's fallback models, billed at theirs
    "cached_content",  # a provider's cache, read as input
    "provider", "transforms", "extra_body", "a_field_from_tomorrow",
])
def test_a_field_off_the_allow_list_is_refused_by_name(api: Api, field: str) -> None:
    doc = {"model": "gpt-4o", "input": "hi"} if api is Api.RESPONSES else {
        "model": "gpt-4o", "messages": MESSAGES, "max_tokens": 10}
    with pytest.raises(FieldUnsupported) as refused:
        plan(api, json.dumps({**doc, field: [{"id": "web"}]}).encode())
    assert (refused.value.code, refused.value.details["field"]) == ("field_unsupported", field)


def test_an_operator_allows_a_field_that_bills_nothing() -> None:
    allowed = frozenset({"transforms"})
    forwarded = plan(Api.CHAT, body(transforms=["middle-out"]), fields_allowed=allowed)
    assert forwarded.body["transforms"] == ["middle-out"]
    with pytest.raises(FieldUnsupported):
        plan(Api.CHAT, body(plugins=[{"id": "web"}]), fields_allowed=allowed)


def test_every_field_a_chat_or_responses_request_may_carry_is_forwarded() -> None:
    chat = plan(Api.CHAT, body(
        temperature=0.5, top_p=1, n=1, stop=["x"], seed=1, frequency_penalty=0,
        presence_penalty=0, logit_bias={"1": 1}, logprobs=True, top_logprobs=2, user="u",
        safety_identifier="s", metadata={"a": "b"}, store=False, reasoning_effort="low",
        verbosity="low", response_format={"type": "json_object"}, prompt_cache_key="k",
        parallel_tool_calls=False, service_tier="default", max_completion_tokens=5))
    assert chat.body["logit_bias"] == {"1": 1}
    responses = plan(Api.RESPONSES, json.dumps({
        "model": "gpt-4o", "input": "hi", "instructions": "be brief", "max_output_tokens": 5,
        "reasoning": {"effort": "low"}, "text": {"verbosity": "low"}, "truncation": "auto",
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "store": False,
        "user": "u", "metadata": {}}).encode())
    assert responses.body["truncation"] == "auto"


@pytest.mark.parametrize("api", [Api.CHAT, Api.RESPONSES, Api.MESSAGES])
@pytest.mark.parametrize("depth", [JSON_DEPTH_MAX + 1, 1_000, 50_000])
def test_a_body_nested_too_deep_is_refused_before_any_parser_recurses(
        api: Api, depth: int) -> None:
    deep = b"[" * depth + b"]" * depth
    with pytest.raises(InvalidRequest):  # not an object, or too deep to parse
        plan(api, deep)
    with pytest.raises(InvalidRequest) as refused:
        plan(api, b'{"model": "gpt-4o", "metadata": ' + deep + b"}")
    assert "nested deeper" in refused.value.message


def test_a_body_at_the_depth_limit_is_priced() -> None:
    nested: Any = "x"
    for _ in range(JSON_DEPTH_MAX - 2):  # the body and its metadata are two levels
        nested = [nested]
    assert plan(Api.CHAT, body(metadata={"deep": nested})).model == "gpt-4o"


def test_text_output_is_the_only_modality_forwarded() -> None:
    assert plan(Api.CHAT, body(modalities=["text"])).body["modalities"] == ["text"]


@pytest.mark.parametrize(("api", "fields", "param"), [
    (Api.CHAT, {"web_search_options": {}}, "web_search_options"),
    (Api.CHAT, {"tools": [{"type": "file_search"}]}, "tools[0]"),
    (Api.CHAT, {"tools": [{"type": ["function"]}]}, "tools[0]"),
    (Api.CHAT, {"tools": [{"type": "web_search"}]}, "tools[0]"),
    (Api.RESPONSES, {"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    (Api.RESPONSES, {"tools": [{"type": "namespace", "tools": [{"type": "mcp"}]}]},
     "tools[0].tools"),
    (Api.RESPONSES, {"input": [{"type": "mcp_approval_response", "id": "x"}]}, "input[0]"),
])
def test_what_nothing_bounds_is_refused_as_unbounded(
    api: Api, fields: dict[str, Any], param: str
) -> None:
    doc = {"model": "gpt-4o", "messages": MESSAGES} if api is Api.CHAT else {
        "model": "gpt-4o", "input": "hi"}
    with pytest.raises(InputUnbounded) as refused:
        plan(api, json.dumps({**doc, **fields}).encode())
    assert (refused.value.code, refused.value.details.get("field")) == ("input_unbounded", param)


@pytest.mark.parametrize(("api", "fields", "param"), [
    (Api.CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "read this"},
        {"type": "file", "file": {"file_id": "file-abc"}}]}]}, "messages[0].content[1].file"),
    (Api.RESPONSES, {"previous_response_id": "resp_1"}, "previous_response_id"),
    (Api.RESPONSES, {"conversation": "conv_1"}, "conversation"),
    (Api.RESPONSES, {"prompt": {"id": "pmpt_1"}}, "prompt"),
    (Api.RESPONSES, {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    (Api.RESPONSES, {"input": [{"type": "reasoning", "id": "rs_1", "summary": [],
                                "encrypted_content": "gAAAA" + "x" * 100}]}, "input[0]"),
    (Api.RESPONSES, {"input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "file-abc"}]}]}, "input[0].content[0]"),
])
def test_input_the_request_only_refers_to_is_held_at_the_context_window(
    api: Api, fields: dict[str, Any], param: str
) -> None:
    doc = {"model": "gpt-4o", "messages": MESSAGES} if api is Api.CHAT else {
        "model": "gpt-4o", "input": "hi"}
    p = plan(api, json.dumps({**doc, **fields, "max_tokens" if api is Api.CHAT else
                              "max_output_tokens": 10}).encode())
    assert p.media.referred_field == param
    # gpt-4o reads at most 128,000 tokens (genai-prices' context_window), each held at $2.50 a
    # million, whatever the body holds; and 10 output tokens at $10.
    prices = PriceTable(now_s=lambda: 1_796_000_000.0)
    held = prices.worst_case_micros("gpt-4o", p.text_tokens_max, 10, media=p.media,
                                    service_tier="default")
    assert held == 128_000 * 25 // 10 + 100


def test_an_image_is_counted_not_read_as_text_and_held_at_the_models_bound() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 500_000}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]
    p = plan(Api.CHAT, body(messages=messages, max_tokens=10, service_tier="default"))
    assert p.text_tokens_max < 400  # the parts' framing and the rest of the body
    assert p.media == Media(images_high=1, image_field="messages[0].content[1].image_url.url")
    assert p.service_tier == "default"
    # gpt-4o at its default rates ($2.50 in, $10 out): the text, 85 + 170 x 8 image tokens, and
    # 10 output tokens. The 1024 x 1024 image was held at its URL's length and billed
    # 765 tokens; whatever its size, it now holds 1,445.
    prices = PriceTable(now_s=lambda: 1_796_000_000.0)
    held = prices.worst_case_micros("gpt-4o", p.text_tokens_max, 10, media=p.media,
                                    service_tier="default")
    assert held == -(-(p.text_tokens_max + 1_445) * 25 // 10) + 100
    assert held > 765 * 2.5 + 100


def test_a_request_that_names_no_tier_is_held_at_the_dearest() -> None:
    assert plan(Api.CHAT, body()).service_tier == "auto"
    assert plan(Api.RESPONSES, json.dumps(
        {"model": "gpt-4o", "input": "hi", "service_tier": "priority"}).encode()
    ).spec().service_tier == "priority"


def test_the_responses_api_takes_a_string_or_items_and_function_tools() -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    p = plan(Api.RESPONSES, json.dumps({"model": "gpt-4o", "input": items, "max_output_tokens": 9,
                                        "tools": [{"type": "function", "name": "f"}]}).encode())
    assert (p.output_tokens_max, p.choices) == (9, 1)
    assert p.text_tokens_max > responses_input(items).text_tokens


def test_a_clamped_plan_forwards_the_smaller_cap_in_the_callers_fields() -> None:
    p = plan(Api.CHAT, body(max_tokens=900, max_completion_tokens=900)).clamped(300)
    sent = json.loads(p.content())
    assert (sent["max_tokens"], sent["max_completion_tokens"], p.output_tokens_max) == (
        300, 300, 300)


# -- reading answers ----------------------------------------------------------------------------


def chunk(**fields: Any) -> bytes:
    return b"data: " + json.dumps({"object": "chat.completion.chunk", **fields}).encode() + b"\n\n"


USAGE = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19,
         "prompt_tokens_details": {"cached_tokens": 4}}
# What a stream's usage chunk and a complete answer without `service_tier` are read as.
USAGE_READ = Usage(12, 7, 4, service_tier="auto")
CHAT_STREAM = b"".join([
    chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
    chunk(choices=[{"index": 0, "delta": {"content": "h\u00e9llo"}}]),
    chunk(choices=[{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": "{\"a\":1}"}}]}}]),
    chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]),
    chunk(choices=[], usage=USAGE),
    b"data: [DONE]\n\n",
])


def fed(tally: StreamTally, stream: bytes, step: int) -> bytes:
    return b"".join(tally.feed(stream[i:i + step]) for i in range(0, len(stream), step))


@pytest.mark.parametrize("step", [1, 7, 64, len(CHAT_STREAM)])
@pytest.mark.parametrize("crlf", [False, True])
def test_a_chat_stream_is_read_the_same_however_it_is_split(step: int, crlf: bool) -> None:
    stream = CHAT_STREAM.replace(b"\n", b"\r\n") if crlf else CHAT_STREAM
    tally = StreamTally(plan(Api.CHAT, body(stream=True)))
    out = fed(tally, stream, step)
    assert tally.usage == USAGE_READ
    assert tally.finished
    # The client did not ask for usage: it gets neither that chunk nor [DONE] (sent after the
    # trailer), and every other event as it came.
    assert b"usage" not in out
    assert b"[DONE]" not in out
    assert out.count(b"\n\n") == 4


def test_the_usage_chunk_is_kept_for_a_client_that_asked_for_it() -> None:
    tally = StreamTally(plan(Api.CHAT, body(stream=True, stream_options={"include_usage": True})))
    assert b'"usage"' in tally.feed(CHAT_STREAM)


def test_a_stream_that_breaks_off_has_no_usage_and_is_not_finished() -> None:
    tally = StreamTally(plan(Api.CHAT, body(stream=True)))
    tally.feed(CHAT_STREAM[: CHAT_STREAM.index(b"finish_reason")])
    assert (tally.usage, tally.finished) == (None, False)


def cumulative(completion_tokens: int) -> bytes:
    """A chunk as vLLM sends it with continuous usage stats: usage so far in every chunk."""
    return chunk(choices=[{"index": 0, "delta": {"content": "x"}}], usage={
        "prompt_tokens": 12, "completion_tokens": completion_tokens,
        "total_tokens": 12 + completion_tokens})


def test_cumulative_usage_settles_from_the_last_report_and_only_at_done() -> None:
    stream = b"".join(cumulative(n) for n in (1, 2, 3, 40)) + b"data: [DONE]\n\n"
    tally = StreamTally(plan(Api.CHAT, body(stream=True)))
    out = tally.feed(stream[: stream.index(b"data: [DONE]")])
    # Usage came with every chunk, but the stream has not ended: it is not complete.
    assert (tally.usage, tally.finished) == (Usage(12, 40, service_tier="auto"), False)
    assert out.count(b"\n\n") == 4  # chunks with choices reach the client, usage and all
    tally.feed(stream[stream.index(b"data: [DONE]"):])
    assert (tally.usage, tally.finished) == (Usage(12, 40, service_tier="auto"), True)


def test_a_responses_stream_settles_on_its_terminal_event() -> None:
    events = [
        ("response.created", {"response": {"id": "r", "usage": None}}),
        ("response.output_text.delta", {"delta": "abc"}),
        ("response.function_call_arguments.delta", {"delta": "{}"}),
        ("response.completed", {"response": {"id": "r", "service_tier": "priority", "usage": {
            "input_tokens": 5, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 0}}}}),
    ]
    stream = b"".join(
        f"event: {kind}\ndata: {json.dumps({'type': kind, **doc})}\n\n".encode()
        for kind, doc in events)
    tally = StreamTally(plan(Api.RESPONSES, json.dumps(
        {"model": "gpt-4o", "input": "hi", "stream": True}).encode()))
    cut = stream.index(b"event: response.completed")
    assert tally.feed(stream[:cut]) == stream[:cut]
    assert (tally.usage, tally.finished) == (None, False)
    assert tally.feed(stream[cut:]) == stream[cut:]
    assert (tally.usage, tally.finished) == (Usage(5, 3, service_tier="priority"), True)


def test_a_complete_answer_gives_its_usage() -> None:
    chat = plan(Api.CHAT, body())
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hey"}}]}
    assert body_outcome(chat, json.dumps({**answer, "usage": USAGE}).encode()) == (USAGE_READ,)
    assert body_outcome(chat, json.dumps(
        {**answer, "usage": USAGE, "service_tier": "default"}).encode()) == (
        Usage(12, 7, 4, service_tier="default"),)
    assert body_outcome(chat, json.dumps(answer).encode()) == (None,)
    assert body_outcome(chat, b"<html>bad gateway</html>") is None
    responses = plan(Api.RESPONSES, json.dumps({"model": "gpt-4o", "input": "hi"}).encode())
    doc = {"output": [{"type": "message", "content": [{"type": "output_text", "text": "yo"}]}],
           "usage": {"input_tokens": 2, "output_tokens": 1}}
    assert body_outcome(responses, json.dumps(doc).encode()) == (
        Usage(2, 1, service_tier="auto"),)


def test_a_stream_reads_the_tier_its_usage_chunk_names() -> None:
    tally = StreamTally(plan(Api.CHAT, body(stream=True)))
    tally.feed(chunk(choices=[], usage=USAGE, service_tier="flex") + b"data: [DONE]\n\n")
    assert tally.usage == Usage(12, 7, 4, service_tier="flex")


@pytest.mark.parametrize(("usage", "read"), [
    # OpenAI: cache reads and audio are parts of prompt_tokens; reasoning and audio parts of
    # completion_tokens, counted once.
    ({"prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150,
      "prompt_tokens_details": {"cached_tokens": 20, "audio_tokens": 30},
      "completion_tokens_details": {"reasoning_tokens": 40, "audio_tokens": 5}},
     Usage(100, 50, cached_input_tokens=20, input_audio_tokens=30, output_audio_tokens=5)),
    # A provider whose completion count leaves reasoning out (its total says so).
    ({"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 150,
      "completion_tokens_details": {"reasoning_tokens": 40}}, Usage(100, 50)),
    # Reasoning above the completion count cannot be part of it.
    ({"prompt_tokens": 100, "completion_tokens": 10,
      "completion_tokens_details": {"reasoning_tokens": 40}}, Usage(100, 50)),
    # Cache writes in the details, as part of prompt_tokens (OpenRouter's way).
    ({"prompt_tokens": 100, "completion_tokens": 1,
      "prompt_tokens_details": {"cached_tokens": 10, "cache_write_tokens": 30}},
     Usage(100, 1, cached_input_tokens=10, cache_write_tokens=30)),
    # Anthropic's counts, beside the input count: 100 + 50 written (20 for 1 h) + 30 read.
    ({"prompt_tokens": 100, "completion_tokens": 1, "cache_creation_input_tokens": 50,
      "cache_read_input_tokens": 30, "cache_creation": {
          "ephemeral_5m_input_tokens": 30, "ephemeral_1h_input_tokens": 20}},
     Usage(180, 1, cached_input_tokens=30, cache_write_tokens=30, cache_write_1h_tokens=20)),
])
def test_a_usage_is_read_the_way_that_costs_no_less(usage: dict[str, Any], read: Usage) -> None:
    assert usage_of(Api.CHAT, usage, "default") == Usage(
        **{**read.__dict__, "service_tier": "default"})


def test_the_responses_usage_and_an_unnamed_tier() -> None:
    usage = {"input_tokens": 100, "output_tokens": 50, "total_tokens": 150,
             "input_tokens_details": {"cached_tokens": 60},
             "output_tokens_details": {"reasoning_tokens": 30}}
    assert usage_of(Api.RESPONSES, usage) == Usage(100, 50, 60, service_tier="auto")


@pytest.mark.parametrize("usage", [
    None, "12", {"prompt_tokens": 12}, {"prompt_tokens": -1, "completion_tokens": 1},
    {"prompt_tokens": "12", "completion_tokens": 1},
    {"prompt_tokens": 12, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 13}},
    {"prompt_tokens": 12, "completion_tokens": 1, "prompt_tokens_details": [1]},
    {"prompt_tokens": 12, "completion_tokens": 1, "completion_tokens_details": {
        "audio_tokens": 2}},
])
def test_a_usage_that_cannot_be_read_is_none(usage: object) -> None:
    assert usage_of(Api.CHAT, usage) is None


# -- settling a call ----------------------------------------------------------------------------

TIERED = {"input_usd_per_mtok": "1", "output_usd_per_mtok": "2",
          "service_tiers": {"priority": {"input_usd_per_mtok": "3", "output_usd_per_mtok": "6"}}}


async def held_call(tmp_path: Path, tag: str, **fields: Any) -> tuple[Call, CeilingService]:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": {"t-m": TIERED}}))
    svc = CeilingService(MemoryStore(), PriceTable.from_file(str(path)))
    await svc.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10_000_000),)))
    key = await svc.create_key(BudgetId(tag), run_ceiling_micros=None)
    who = await svc.authenticate(key.api_key)
    call_plan = plan(Api.CHAT, body(model="t-m", max_tokens=10, **fields))
    lengths = OutputLengths()
    return Call(svc, who, await hold(svc, who, call_plan, lengths, clamp=False, p95=False),
                lengths), svc


@pytest.mark.parametrize(("asked", "answered", "charged"), [
    # 100 in and 10 out: $1/$2 a million at the default tier, $3/$6 at priority.
    ({}, "default", 100 + 20),
    ({}, "priority", 300 + 60),
    ({}, None, 300 + 60),  # named no tier, served at one no answer names: the dearest
    ({"service_tier": "default"}, None, 100 + 20),  # served at the one it asked for
    ({"service_tier": "priority"}, None, 300 + 60),
])
async def test_a_call_is_charged_at_the_tier_its_answer_names_or_it_asked_for(
    tmp_path: Path, tag: str, asked: dict[str, Any], answered: str | None, charged: int
) -> None:
    call, _ = await held_call(tmp_path, tag, **asked)
    usage = usage_of(Api.CHAT, {"prompt_tokens": 100, "completion_tokens": 10}, answered)
    bill = await call.settle(usage)
    assert (bill.outcome, bill.charged_micros) == (Outcome.BILLED, charged)


async def test_a_usage_that_cannot_be_priced_keeps_the_hold(tmp_path: Path, tag: str) -> None:
    call, svc = await held_call(tmp_path, tag)
    # Audio for a model without an audio rate: never priced as text; the hold stays for expiry.
    bill = await call.settle(Usage(100, 10, input_audio_tokens=50, service_tier="default"))
    assert bill.outcome is Outcome.UNKNOWN
    assert bill.charged_micros == call.hold.reservation.reserved_micros
    assert (await svc.my_budgets(call.who))[0].reserved_micros == bill.charged_micros


async def test_without_a_usage_a_call_is_charged_its_whole_worst_case(
    tmp_path: Path, tag: str
) -> None:
    call, _ = await held_call(tmp_path, tag)
    bill = await call.settle(None)
    # Hidden reasoning tokens are not in the visible answer: the input's bound and the whole
    # output cap, at the dearest tier ($3 in, $6 out), as held.
    assert (bill.outcome, bill.charged_micros) == (
        Outcome.ESTIMATED, call.hold.plan.text_tokens_max * 3 + 10 * 6)
    assert bill.charged_micros == call.hold.reservation.reserved_micros


# -- output lengths -----------------------------------------------------------------------------


class Histograms:
    def __init__(self, histogram: dict[int, int]) -> None:
        self.histogram, self.reads = histogram, 0

    async def output_histogram(self, model: str) -> dict[int, int]:
        self.reads += 1
        return self.histogram


async def test_a_models_p95_is_read_once_per_cache_period() -> None:
    now_s = [0.0]
    lengths = OutputLengths(clock=lambda: now_s[0])
    store = Histograms({20: 95, 200: 5})
    assert await lengths.p95_tokens(store, "gpt-4o") == 20  # type: ignore[arg-type]
    store.histogram = {500: 100}
    assert await lengths.p95_tokens(store, "GPT-4o") == 20  # type: ignore[arg-type]
    now_s[0] = 31.0
    assert await lengths.p95_tokens(store, "gpt-4o") == 500  # type: ignore[arg-type]
    assert store.reads == 2
    assert await lengths.p95_tokens(Histograms({20: 10}), "other") is None  # type: ignore[arg-type]


# -- idempotency state --------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def reply_store(
    request: pytest.FixtureRequest, redis_server: RedisServer, clock: ManualClock
) -> AsyncIterator[ReplyStore]:
    if request.param == "memory":
        yield MemoryReplies(clock)
        return
    transport = RedisTransport(redis_client(redis_server.url))
    yield ScriptedReplies(transport)
    await transport.close()


REPLY = StoredReply(200, (("content-type", "application/json"),), '{"id": "x"}')
NOT_KEPT = StoredReply(409, (), '{"error": {"code": "reply_not_kept"}}')
OWNER = GATEWAY_OWNER_PREFIX + "key_1"
BILL = Bill("r1", 100, 60, Outcome.BILLED, None, None)


async def test_a_key_is_claimed_once_then_replays_its_answer(
    reply_store: ReplyStore, tag: str
) -> None:
    ref = ReplyRef(tag, "d1", OWNER)
    assert (await reply_store.claim(ref, "fp", "t1", 60_000)).kind is ClaimKind.CLAIMED
    # Resent claims by the same attempt (a lost reply) are still its own.
    assert (await reply_store.claim(ref, "fp", "t1", 60_000)).kind is ClaimKind.CLAIMED
    assert (await reply_store.claim(ref, "fp", "t2", 60_000)).kind is ClaimKind.IN_FLIGHT
    assert (await reply_store.claim(ref, "other", "t2", 60_000)).kind is ClaimKind.CONFLICT
    assert await reply_store.complete(ref, "t2", REPLY, 60_000) is Kept.LOST
    assert await reply_store.complete(ref, "t1", REPLY, 60_000) is Kept.KEPT
    assert await reply_store.complete(ref, "t1", REPLY, 60_000) is Kept.KEPT
    await reply_store.abandon(ref, "t1")  # a finished answer is never given back
    done = await reply_store.claim(ref, "fp", "t3", 60_000)
    assert (done.kind, done.reply) == (ClaimKind.DONE, REPLY)


async def test_an_abandoned_key_can_be_claimed_again(reply_store: ReplyStore, tag: str) -> None:
    ref = ReplyRef(tag, "d2", OWNER)
    await reply_store.claim(ref, "fp", "t1", 60_000)
    await reply_store.abandon(ref, "t2")  # not its claim: ignored
    assert (await reply_store.claim(ref, "fp", "t2", 60_000)).kind is ClaimKind.IN_FLIGHT
    await reply_store.abandon(ref, "t1")
    await reply_store.abandon(ref, "t1")
    assert (await reply_store.claim(ref, "fp", "t2", 60_000)).kind is ClaimKind.CLAIMED


async def test_a_claim_of_a_dead_instance_ends_with_its_ttl(clock: ManualClock, tag: str) -> None:
    store = MemoryReplies(clock)
    ref = ReplyRef(tag, "d3", OWNER)
    await store.claim(ref, "fp", "t1", 1_000)
    clock.advance(1_001)  # Redis drops a key once its time is past its expiry, not at it
    assert (await store.claim(ref, "fp", "t2", 1_000)).kind is ClaimKind.CLAIMED


class FakeTime:
    def __init__(self) -> None:
        self.now_s = 0.0

    def clock(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.now_s += seconds


async def test_a_waiting_retry_gets_the_answer_and_a_late_one_gives_up(tag: str) -> None:
    store = MemoryReplies()
    time = FakeTime()
    ref = ReplyRef(tag, "d4", OWNER)
    first = await claim(store, ref, "fp", wait=True, in_flight_ttl_ms=60_000)
    assert isinstance(first, Ticket)
    with pytest.raises(IdempotencyInFlight) as busy:
        await claim(store, ref, "fp", wait=True, in_flight_ttl_ms=60_000,
                    sleep=time.sleep, clock=time.clock)
    assert busy.value.details["retry_after_s"] == IN_FLIGHT_RETRY_AFTER_S
    assert IN_FLIGHT_WAIT_S_MAX - 0.5 <= time.now_s <= IN_FLIGHT_WAIT_S_MAX
    with pytest.raises(IdempotencyInFlight):
        await claim(store, ref, "fp", wait=False, in_flight_ttl_ms=60_000)

    async def finish_on_first_poll(seconds: float) -> None:
        await first.complete(REPLY, NOT_KEPT)

    assert await claim(store, ref, "fp", wait=True, in_flight_ttl_ms=60_000,
                       sleep=finish_on_first_poll) == REPLY
    with pytest.raises(IdempotencyConflict):
        await claim(store, ref, "another body", wait=True, in_flight_ttl_ms=60_000)


class GatedReplies(MemoryReplies):
    """Replies whose answers are kept only once the test opens the gate: a slow ledger."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def complete(self, ref: ReplyRef, token: str, reply: StoredReply, ttl_ms: int,
                       *, counted: bool = True) -> Kept:
        await self.gate.wait()
        return await super().complete(ref, token, reply, ttl_ms, counted=counted)


async def test_an_answer_is_kept_while_it_is_sent_and_even_when_sending_fails(tag: str) -> None:
    store = GatedReplies()

    async def kept_answer(digest: str) -> tuple[ReplyRef, Response]:
        ref = ReplyRef(tag, digest, OWNER)
        ticket = await claim(store, ref, "fp", wait=False, in_flight_ttl_ms=60_000)
        assert isinstance(ticket, Ticket)
        chat = FORMATS[Api.CHAT]
        return ref, answered(chat, kept_while_sent(
            b'{"id": "x"}', 200, {"content-type": "application/json"}, ticket, BILL, chat,
            Shapes()))

    async def kind(ref: ReplyRef) -> ClaimKind:
        return (await store.claim(ref, "fp", "retry", 60_000)).kind

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    ref, answer = await kept_answer("d5")
    sent = asyncio.Event()

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            sent.set()

    request = asyncio.create_task(answer({"type": "http"}, receive, send))
    await asyncio.wait_for(sent.wait(), 10)
    # The client has its answer while the ledger is still keeping it; the request is not over.
    assert (await kind(ref), request.done()) == (ClaimKind.IN_FLIGHT, False)
    store.gate.set()
    await asyncio.wait_for(request, 10)
    kept = (await store.claim(ref, "fp", "retry", 60_000)).reply
    assert kept is not None
    assert unpacked(kept) == StoredReply(
        200, (("content-type", "application/json"),), '{"id": "x"}')

    # A client whose connection broke is the one that retries: its answer is kept all the same.
    ref, answer = await kept_answer("d6")

    async def broken(message: Message) -> None:
        raise ConnectionResetError("connection reset by peer")

    with pytest.raises(ConnectionResetError, match="reset"):
        await answer({"type": "http"}, receive, broken)
    for _ in range(100):
        if await kind(ref) is ClaimKind.DONE:
            break
        await asyncio.sleep(0.01)
    assert await kind(ref) is ClaimKind.DONE


async def test_answers_are_kept_compressed_and_a_key_keeps_at_most_its_quota_of_bytes(
    reply_store: ReplyStore, tag: str
) -> None:
    """Answers that do not compress, each near the most one may take kept: the key keeps them
    until its quota of bytes is used; every later one leaves the note a retry is answered with,
    and none is lost."""
    noise = random.Random(7)
    size = REPLY_STORED_BYTES_MAX * 2 // 3  # base64 of random bytes: stays near this packed
    kept_bytes, notes = 0, 0
    for i in range(REPLY_BYTES_PER_KEY_MAX // size + 3):
        ref = ReplyRef(tag, f"q{i}", OWNER)
        ticket = await claim(reply_store, ref, "fp", wait=False, in_flight_ttl_ms=60_000)
        assert isinstance(ticket, Ticket)
        body = base64.b64encode(noise.randbytes(size * 3 // 4)).decode()
        answer = StoredReply(200, (), body)
        kept = await ticket.complete(answer, NOT_KEPT)
        replay = await claim(reply_store, ref, "fp", wait=False, in_flight_ttl_ms=60_000)
        if kept is Kept.KEPT:
            assert replay == answer
            kept_bytes += len(packed(answer).body) + len("[]")
        else:
            assert replay == NOT_KEPT
            notes += 1
    assert kept_bytes <= REPLY_BYTES_PER_KEY_MAX < kept_bytes + size * 2
    assert notes >= 3
    # Another key's quota is its own.
    other = ReplyRef(tag, "q-other", GATEWAY_OWNER_PREFIX + "key_2")
    ticket = await claim(reply_store, other, "fp", wait=False, in_flight_ttl_ms=60_000)
    assert isinstance(ticket, Ticket)
    assert await ticket.complete(REPLY, NOT_KEPT) is Kept.KEPT


async def test_a_chat_answer_is_kept_in_a_fraction_of_its_bytes() -> None:
    stream = "".join(f'data: {{"choices":[{{"delta":{{"content":"word {i} "}},"logprobs":'
                     f'{{"content":[{{"token":"word","logprob":-0.{i % 97}}}]}}}}]}}\n\n'
                     for i in range(5_000))
    kept = packed(StoredReply(200, (), stream))
    assert len(kept.body) * 5 < len(stream)
    assert unpacked(kept).body == stream


async def test_a_key_claims_at_most_its_quota_of_idempotency_keys(
    reply_store: ReplyStore, tag: str
) -> None:
    for i in range(REPLIES_PER_KEY_MAX):
        found = await reply_store.claim(ReplyRef(tag, f"c{i}", OWNER), "fp", "t", 60_000)
        assert found.kind is ClaimKind.CLAIMED
    with pytest.raises(StateQuota) as refused:
        await reply_store.claim(ReplyRef(tag, "c-last", OWNER), "fp", "t", 60_000)
    assert refused.value.details["quota"] == "replies"
    # A key already claimed is still answered; another API key claims its own.
    again = await reply_store.claim(ReplyRef(tag, "c0", OWNER), "fp", "t", 60_000)
    assert again.kind is ClaimKind.CLAIMED
    other = ReplyRef(tag, "c0", GATEWAY_OWNER_PREFIX + "key_2")
    assert (await reply_store.claim(other, "fp", "t", 60_000)).kind is ClaimKind.CLAIMED
