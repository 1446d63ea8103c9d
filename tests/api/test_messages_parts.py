"""Anthropic's Messages API in the gateway's parts, without servers: pricing a request, reading
its usage and its stream, its errors' shape.

The end-to-end suites (test_messages.py, test_hostile_messages.py) judge the same paths by the
stub's bill; here every branch is reached on its own, streams split at every byte among them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api import errors
from api.refusals import error_event, refusal_response
from core.budgets import BudgetDef, BudgetId, Limit, Period
from core.content import CLAUDE_IMAGE_TOKENS_MAX
from core.errors import BudgetExceeded, FieldUnsupported, InputUnbounded, InvalidRequest
from core.formats import Api, StreamTally
from core.formats.messages import (
    ANTHROPIC_TYPES,
    CONTEXT_1M_BETA,
    MESSAGES,
    MESSAGES_FIELDS,
    TOOL_USE_SYSTEM_PROMPT_TOKENS_MAX,
    WEB_SEARCH_MAX_USES_DEFAULT,
    merged_usage,
)
from core.gateway import OutputLengths, hold
from core.gateway_request import body_outcome, plan, usage_of
from core.prices import TIER_AUTO, TIER_DEFAULT, PriceTable, Usage
from core.service import CeilingService
from core.stores.memory import MemoryStore

HELLO = [{"role": "user", "content": "hello"}]
VERSION = ("anthropic-version", "2023-06-01")


def messages_plan(headers: tuple[tuple[str, str], ...] = (VERSION,), **fields: Any) -> Any:
    doc = {"model": "claude-sonnet-4-5", "messages": HELLO, "max_tokens": 100, **fields}
    return plan(Api.MESSAGES, json.dumps(doc).encode(), headers=headers)


def refused(headers: tuple[tuple[str, str], ...] = (VERSION,), **fields: Any) -> str:
    with pytest.raises(InvalidRequest) as info:
        messages_plan(headers, **fields)
    return str(info.value.details.get("field"))


# -- pricing a request --------------------------------------------------------------------------


def test_the_cap_is_max_tokens_or_the_default_which_is_forwarded() -> None:
    given = messages_plan()
    assert (given.output_tokens_max, given.choices, given.api) == (100, 1, Api.MESSAGES)
    doc = {"model": "claude-sonnet-4-5", "messages": HELLO}
    defaulted = plan(Api.MESSAGES, json.dumps(doc).encode(), 512)
    assert (defaulted.output_tokens_max, defaulted.body["max_tokens"]) == (512, 512)
    assert refused(max_tokens=0) == "max_tokens"


def test_the_version_and_betas_are_forwarded_and_nothing_else() -> None:
    headers = (VERSION, ("anthropic-beta", "interleaved-thinking-2025-05-14"))
    assert messages_plan(headers).headers == headers


def test_tools_add_their_bytes_and_the_largest_tool_use_system_prompt() -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    plain, with_tool = messages_plan(), messages_plan(tools=[tool])
    tool_bytes = len(json.dumps({"tools": [tool]}).encode()) - len(b"{}")
    assert with_tool.text_tokens_max - plain.text_tokens_max >= (
        TOOL_USE_SYSTEM_PROMPT_TOKENS_MAX + tool_bytes)
    # The system prompt is text, by its bytes.
    system = "x" * 10_000
    assert messages_plan(system=system).text_tokens_max - plain.text_tokens_max > 10_000


def test_images_are_counted_at_the_models_per_image_bound() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    found = messages_plan(messages=[{"role": "user", "content": [image, image]}])
    assert (found.media.images_high, found.media.image_field) == (
        2, "messages[0].content[0].source")
    table = PriceTable()
    text_only = messages_plan()
    # $3 in for every token (the dearest input-side rate the call can be billed: a 5-minute
    # write, $3.75; it asks for no 1-hour entry), $15 out.
    assert table.worst_case_micros(found.model, found.text_tokens_max, 100,
                                   media=found.media) >= (
        table.worst_case_micros(text_only.model, text_only.text_tokens_max, 100)
        + 2 * CLAUDE_IMAGE_TOKENS_MAX * 375 // 100)


@pytest.mark.parametrize(("fields", "field"), [
    ({"speed": "fast"}, "speed"),
    ({"inference_geo": "us"}, "inference_geo"),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example"}]}, "mcp_servers"),
    ({"container": "c_1"}, "container"),
    ({"context_management": {"edits": [{"type": "summarize_somehow_2027"}]}},
     "context_management.edits[0]"),
    ({"tools": [{"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 1}]},
     "tools[0]"),
    ({"tools": [{"type": "code_execution_20250825", "name": "code_execution"}]}, "tools[0]"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"),
    ({"system": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]},
     "system"),
    ({"thinking": {"type": "enabled", "budget_tokens": 101}}, "thinking.budget_tokens"),
])
def test_what_the_gateway_cannot_bound_is_refused_by_its_field(
    fields: dict[str, Any], field: str
) -> None:
    with pytest.raises((InputUnbounded, FieldUnsupported)) as info:
        messages_plan(**fields)
    assert info.value.details["field"] == field
    # A top-level field off the allow-list is refused as unsupported, by its name.
    top_level = field in fields and field not in MESSAGES_FIELDS
    assert isinstance(info.value, FieldUnsupported) is top_level


@pytest.mark.parametrize("beta", ["fast-mode-2026-02-01", "code-execution-2025-08-25",
                                  "mcp-client-2025-04-04", "a-beta-from-tomorrow"])
def test_betas_the_gateway_does_not_know_are_refused(beta: str) -> None:
    headers = (VERSION, ("anthropic-beta", f"interleaved-thinking-2025-05-14, {beta}"))
    assert refused(headers) == "anthropic-beta"


def test_a_thinking_budget_inside_max_tokens_is_forwarded_and_clamped_with_it() -> None:
    thinking = {"type": "enabled", "budget_tokens": 80}
    call = messages_plan(thinking=thinking)
    assert call.body["thinking"] == thinking
    clamped = call.clamped(50)
    assert (clamped.body["max_tokens"], clamped.body["thinking"]["budget_tokens"]) == (50, 49)


def test_a_web_search_counts_its_max_uses() -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]
    found = messages_plan(tools=tools)
    assert (found.media.web_searches, found.media.web_search_field) == (3, "tools[1]")


def test_a_web_search_without_max_uses_is_sent_with_the_gateways_and_says_so() -> None:
    tools = [{"type": "web_search_20250305", "name": "web_search"}]
    found = messages_plan(tools=tools)
    assert found.body["tools"][0]["max_uses"] == WEB_SEARCH_MAX_USES_DEFAULT
    assert found.media.web_searches == WEB_SEARCH_MAX_USES_DEFAULT
    assert ("tools[0].max_uses", WEB_SEARCH_MAX_USES_DEFAULT) in found.bounds_added


@pytest.mark.parametrize("beta", [
    "claude-code-20250219", "context-management-2025-06-27", "advanced-tool-use-2025-11-20",
    "effort-2025-11-24", "structured-outputs-2025-11-13", "interleaved-thinking-2025-05-14",
])
def test_the_betas_real_clients_send_are_known(beta: str) -> None:
    messages_plan((VERSION, ("anthropic-beta", beta)))


def test_an_operator_names_a_beta_that_bills_nothing_more() -> None:
    headers = (VERSION, ("anthropic-beta", "a-beta-from-tomorrow"))
    raw = json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": [
        {"role": "user", "content": "hi"}]}).encode()
    plan(Api.MESSAGES, raw, headers=headers, betas_allowed=frozenset({"a-beta-from-tomorrow"}))


def test_context_edits_that_clear_keep_the_bodys_bound_and_compaction_holds_the_window() -> None:
    clearing = {"edits": [{"type": "clear_tool_uses_20250919"},
                          {"type": "clear_thinking_20251015", "keep": "all"}]}
    found = messages_plan(context_management=clearing)
    assert not found.media.referred_field
    assert not found.media.compaction_field
    compacting = {"edits": [{"type": "compact_20260112"}]}
    found = messages_plan(context_management=compacting)
    assert found.media.compaction_field == "context_management.edits[0]"
    table = PriceTable()
    # claude-sonnet-4-5: the compacting step and the answer each read up to 200,000 tokens; at
    # 400,000 together the long-context rates apply: $7.50 a million (a 5-minute cache write),
    # and twice the 100-token cap out at $22.50.
    assert table.worst_case_micros(found.model, found.text_tokens_max, 100,
                                   media=found.media) == 400_000 * 75 // 10 + 2 * 100 * 225 // 10


def test_output_config_is_held_with_a_system_prompt_for_a_format() -> None:
    plain = messages_plan()
    effort = messages_plan(output_config={"effort": "high"})
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    formatted = messages_plan(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert effort.text_tokens_max - plain.text_tokens_max < 40  # the field's bytes
    assert formatted.text_tokens_max - plain.text_tokens_max > TOOL_USE_SYSTEM_PROMPT_TOKENS_MAX


def test_anthropics_tiers_are_the_default_rates_or_the_dearest() -> None:
    assert messages_plan(service_tier="standard_only").service_tier == TIER_DEFAULT
    assert messages_plan(service_tier="auto").service_tier == TIER_AUTO
    assert messages_plan().service_tier == TIER_AUTO


async def test_the_1m_context_beta_needs_the_models_long_context_rates(tag: str) -> None:
    """claude-sonnet-4-5 has them in genai-prices (a tier above 200K input tokens);
    claude-sonnet-4 does not, though Anthropic bills it at them with the beta."""
    svc = CeilingService(MemoryStore(), PriceTable())
    await svc.put_budget(BudgetDef(BudgetId(tag), (Limit(Period.TOTAL, 10_000_000_000),)))
    who = await svc.authenticate((await svc.create_key(BudgetId(tag), None)).api_key)
    headers = (VERSION, ("anthropic-beta", CONTEXT_1M_BETA))
    big = [{"role": "user", "content": "x" * 900_000}]
    held = await hold(svc, who, messages_plan(headers, messages=big), OutputLengths(),
                      clamp=False, p95=False)
    # Above 200K tokens: every input token at the long-context 5-minute write ($7.50), output
    # $22.50.
    assert held.reservation.reserved_micros >= 900_000 * 7.5 + 100 * 22.5
    with pytest.raises(InputUnbounded) as unknown:
        await hold(svc, who, messages_plan(headers, model="claude-sonnet-4"), OutputLengths(),
                   clamp=False, p95=False)
    assert unknown.value.details["field"] == "anthropic-beta"


# -- reading what the provider billed -------------------------------------------------------------

FULL_USAGE = {
    "input_tokens": 20, "output_tokens": 30, "cache_read_input_tokens": 1_000,
    "cache_creation_input_tokens": 300,
    "cache_creation": {"ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 200},
    "service_tier": "standard", "server_tool_use": {"web_search_requests": 2},
}
# Cache reads and writes are beside the input count: 20 + 1,000 + 300 in.
FULL_READ = Usage(1_320, 30, cached_input_tokens=1_000, cache_write_tokens=100,
                  cache_write_1h_tokens=200, service_tier=TIER_DEFAULT, web_search_requests=2)


def test_a_usage_is_read_with_its_cache_its_searches_and_its_tier() -> None:
    assert usage_of(Api.MESSAGES, FULL_USAGE) == FULL_READ
    assert usage_of(Api.MESSAGES, {"input_tokens": 3, "output_tokens": 4}) == Usage(
        3, 4, service_tier=TIER_AUTO)
    assert usage_of(Api.MESSAGES, {**FULL_USAGE, "service_tier": "priority"}) == Usage(
        1_320, 30, 1_000, 100, 200, service_tier="priority", web_search_requests=2)
    assert usage_of(Api.MESSAGES, {"input_tokens": -1, "output_tokens": 4}) is None


def test_a_complete_message_gives_its_usage() -> None:
    call = messages_plan()
    message = {"type": "message", "content": [{"type": "text", "text": "hi"}]}
    assert body_outcome(call, json.dumps({**message, "usage": FULL_USAGE}).encode()) == (
        FULL_READ,)
    assert body_outcome(call, json.dumps(message).encode()) == (None,)


def sse(kind: str, doc: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **doc})}\n\n".encode()


START_USAGE = {**FULL_USAGE, "output_tokens": 1,
               "server_tool_use": {"web_search_requests": 0}}
MESSAGES_STREAM = b"".join([
    sse("message_start", {"message": {"id": "msg_1", "usage": START_USAGE}}),
    sse("ping", {}),
    sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "h\u00e9"}}),
    sse("content_block_stop", {"index": 0}),
    sse("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {
        "output_tokens": 30, "server_tool_use": {"web_search_requests": 2}}}),
    sse("message_stop", {}),
])


@pytest.mark.parametrize("step", [1, 5, 64, len(MESSAGES_STREAM)])
@pytest.mark.parametrize("crlf", [False, True])
def test_a_stream_settles_from_message_start_and_the_last_delta_at_message_stop(
    step: int, crlf: bool
) -> None:
    stream = MESSAGES_STREAM.replace(b"\n", b"\r\n") if crlf else MESSAGES_STREAM
    tally = StreamTally(messages_plan(stream=True))
    out = b"".join(tally.feed(stream[i:i + step]) for i in range(0, len(stream), step))
    assert (tally.usage, tally.finished) == (FULL_READ, True)
    assert out == MESSAGES_STREAM  # every event reaches the client as it came


def test_a_stream_without_message_stop_is_not_complete() -> None:
    tally = StreamTally(messages_plan(stream=True))
    cut = MESSAGES_STREAM.index(b"event: message_stop")
    tally.feed(MESSAGES_STREAM[:cut])
    assert (tally.usage, tally.finished) == (None, False)
    error = sse("error", {"error": {"type": "overloaded_error", "message": "busy"}})
    tally.feed(error)
    assert (tally.usage, tally.finished) == (None, False)


def test_a_delta_that_adds_cache_writes_without_their_ttl_reads_them_as_1_hour() -> None:
    start = {"input_tokens": 5, "output_tokens": 1, "cache_creation_input_tokens": 100,
             "cache_creation": {"ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 0}}
    merged = merged_usage(start, {"output_tokens": 9, "cache_creation_input_tokens": 400})
    assert usage_of(Api.MESSAGES, merged) == Usage(405, 9, cache_write_tokens=100,
                                                   cache_write_1h_tokens=300,
                                                   service_tier=TIER_AUTO)


# -- refusals in Anthropic's shape -----------------------------------------------------------------


def test_every_error_code_has_an_anthropic_type() -> None:
    assert set(ANTHROPIC_TYPES) >= set(errors.STATUS)


def test_a_spent_budget_is_a_402_billing_error_the_sdk_is_told_not_to_retry() -> None:
    refusal = BudgetExceeded("no room left", budget_id="org:a", period="total",
                             remaining_micros=5)
    response = refusal_response(MESSAGES, refusal, {"x-ceiling-reserved-micros": "0"})
    assert response.status_code == 402
    assert json.loads(bytes(response.body)) == {"type": "error", "error": {
        "type": "billing_error", "message": "no room left", "code": "budget_exceeded",
        "budget_id": "org:a", "period": "total", "remaining_micros": 5}}
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["x-ceiling-reserved-micros"] == "0"


def test_a_broken_stream_ends_on_an_error_event_in_anthropics_shape(tmp_path: Path) -> None:
    event = error_event(MESSAGES, InvalidRequest("gone", field="x"))
    kind, data = event.decode().strip().split("\n")
    assert kind == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "gone", "code": "invalid_request",
        "field": "x"}}


def test_a_1_hour_write_rate_is_held_only_where_a_call_asks_for_a_1_hour_entry() -> None:
    table = PriceTable()
    system = [{"type": "text", "text": "Rule. " * 2_000, "cache_control": {"type": "ephemeral"}}]
    five_minutes = messages_plan(system=system)
    one_hour = messages_plan(system=[{**system[0], "cache_control": {"type": "ephemeral",
                                                                     "ttl": "1h"}}])
    assert five_minutes.media.cache_1h is False
    assert one_hour.media.cache_1h is True

    def input_micros(found: Any) -> int:
        return int(table.worst_case_micros(found.model, found.text_tokens_max, 1,
                                           media=found.media) - 15)

    # claude-sonnet-4-5: a 5-minute write is $3.75 a million, a 1-hour one $6.
    assert input_micros(five_minutes) == -(-five_minutes.text_tokens_max * 375 // 100)
    assert input_micros(one_hour) == one_hour.text_tokens_max * 6


def test_thinking_sent_back_is_held_at_the_models_output_maximum_a_block() -> None:
    """claude-sonnet-4-5 writes at most 64,000 tokens a call; its window is 200,000. One block:
    64,000 at the 5-minute write's $3.75; four: the window, the body's tokens among it."""
    table = PriceTable()
    thinking = {"type": "thinking", "thinking": "", "signature": "sig"}

    def held(blocks: int) -> int:
        turns = [{"role": "user", "content": "weather?"},
                 {"role": "assistant", "content": [*[thinking] * blocks, {
                     "type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                               "content": "sunny"}]}]
        found = messages_plan(messages=turns, max_tokens=1)
        return int(table.worst_case_micros(found.model, found.text_tokens_max, 1,
                                           media=found.media))

    assert 64_000 * 375 // 100 < held(1) < 65_000 * 375 // 100
    assert held(4) == 200_000 * 375 // 100 + 15
