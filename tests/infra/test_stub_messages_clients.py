"""What real Anthropic clients send (Claude Code 2.1, the `anthropic` SDK, the AI SDK), served and
billed by the stub as Anthropic bills it, beyond the body included.

Context editing and compaction (https://platform.claude.com/docs/en/build-with-claude/
context-editing, .../compaction), structured outputs and effort (.../structured-outputs,
.../effort), adaptive thinking, the betas and tool fields Claude Code sends, scripted tool calls
for agent tests, count_tokens with all of it. Every figure is worked by hand beside it (the
stub's text rule: a block's UTF-8 bytes over four, rounded up; 4 tokens a message, 3 for the
reply); calls go through the real `anthropic` SDK, raw httpx where a test reads the wire.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pydantic
import pytest

from infra.stub_messages import schema_instance
from infra.stub_provider import CallRecord, StubProvider
from tests.infra.conftest import start_fresh
from tests.infra.test_stub_provider import bill_of, forced, sse_data

# The SDK warns that claude-opus-4-5 is deprecated; the table still prices it, as Anthropic does.
pytestmark = pytest.mark.filterwarnings("ignore:The model .* is deprecated:DeprecationWarning")

KEY = "sk-ant-stub"
VERSION = {"anthropic-version": "2023-06-01"}
SONNET = "claude-sonnet-4-5"
OPUS_45 = "claude-opus-4-5"  # keeps every turn's thinking
OPUS_55 = "claude-opus-5-5"  # Claude Code 2.1's default: $4 / $20, 1M window
CONTEXT_BETA = "context-management-2025-06-27"
# Every beta Claude Code 2.1.332 sent on `claude -p` (its anthropic-beta header, read off the
# wire), and the ones the SDKs send for structured outputs and streaming.
CLAUDE_CODE_BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", CONTEXT_BETA,
                     "per-turn-control-2026-07-01", "mid-conversation-tool-changes-2026-07-01",
                     "thinking-token-count-2026-05-13", "advanced-tool-use-2025-11-20",
                     "effort-2025-11-24", "structured-outputs-2025-11-13",
                     "fine-grained-tool-streaming-2025-05-14", "token-efficient-tools-2025-02-19",
                     "prompt-caching-scope-2026-01-05", "oauth-2025-04-20",
                     "compact-2026-01-12"]
# "[cleared by context management]": 31 bytes -> 8 tokens, what a cleared result becomes.
PLACEHOLDER_TOKENS = 8
# A tool result of 4,000 bytes: 1,000 tokens.
RESULT = "r" * 4_000
RESULT_TOKENS = 1_000


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=11, latency_ms_min=0, latency_ms_max=2, api_key=KEY) as stub:
        yield stub


@pytest.fixture(scope="module")
def http(provider: StubProvider) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=provider.url, timeout=30.0,
                      headers={"x-api-key": KEY, **VERSION}) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(provider: StubProvider) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=provider.url, api_key=KEY, max_retries=0, timeout=30.0)


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"prompt_cache": True, "tool_calls": []})


def beta(sdk: anthropic.Anthropic, tokens: int = 10, **kwargs: Any) -> Any:
    """A call through the SDK's beta surface answering `tokens` output tokens."""
    kwargs.setdefault("model", SONNET)
    kwargs.setdefault("max_tokens", 100)
    kwargs.setdefault("betas", [CONTEXT_BETA])
    kwargs.setdefault("messages", [{"role": "user", "content": "hello"}])
    return sdk.beta.messages.create(**kwargs, extra_headers=forced(tokens))


def last_call(http: httpx.Client) -> CallRecord:
    return bill_of(http).log[-1]


def tool_history(uses: int, names: tuple[str, ...] = ("f",)) -> Any:
    """A conversation of `uses` tool calls, each answered with RESULT, then a question."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(uses):
        name = names[i % len(names)]
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": name,
                                               "input": {"q": "x" * 40}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                          "content": RESULT}]}]
    return messages


def tools_named(*names: str) -> Any:
    return [{"name": n, "input_schema": {"type": "object"}} for n in names]


def clear_tool_uses(**rule: Any) -> Any:
    return {"edits": [{"type": "clear_tool_uses_20250919", **rule}]}


TRIGGER_LOW = {"type": "input_tokens", "value": 1_000}


# -- clear_tool_uses_20250919 ------------------------------------------------------------------


def test_cleared_tool_results_are_not_billed_and_the_answer_says_what_was_cleared(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    whole = beta(sdk, tools=tools_named("f"), messages=tool_history(5))
    message = beta(sdk, tools=tools_named("f"), messages=tool_history(5),
                   context_management=clear_tool_uses(
                       trigger=TRIGGER_LOW, keep={"type": "tool_uses", "value": 2}))
    # The three oldest of five results are replaced by the placeholder: 3 x (1,000 - 8).
    cleared = 3 * (RESULT_TOKENS - PLACEHOLDER_TOKENS)
    assert cleared == 2_976
    edits = message.context_management.applied_edits
    assert [(e.type, e.cleared_tool_uses, e.cleared_input_tokens) for e in edits] == [
        ("clear_tool_uses_20250919", 3, cleared)]
    assert message.usage.input_tokens == whole.usage.input_tokens - cleared
    call = last_call(http)
    assert call.beyond_body == {"cleared_tool_input_tokens": cleared}
    assert call.usage is not None
    assert call.usage.input_tokens == message.usage.input_tokens
    # $3 / $15 a million: the input left and 10 output tokens.
    assert call.cost_micros == message.usage.input_tokens * 3 + 150


def test_the_default_keeps_three_tool_uses_and_triggers_at_100k_tokens(
    sdk: anthropic.Anthropic
) -> None:
    # 5 x 1,000 tokens of results is under the default 100,000-token trigger: nothing cleared.
    quiet = beta(sdk, tools=tools_named("f"), messages=tool_history(5),
                 context_management=clear_tool_uses())
    assert quiet.context_management is None
    # A tool-use trigger of 4 is passed by 5 uses; the default keep of 3 clears 2.
    message = beta(sdk, tools=tools_named("f"), messages=tool_history(5),
                   context_management=clear_tool_uses(trigger={"type": "tool_uses", "value": 4}))
    assert message.context_management.applied_edits[0].cleared_tool_uses == 2


def test_excluded_tools_stay_and_clear_at_least_holds_back_a_small_clearing(
    sdk: anthropic.Anthropic
) -> None:
    history = tool_history(4, names=("f", "memory"))  # f, memory, f, memory
    keep_none = {"type": "tool_uses", "value": 0}
    message = beta(sdk, tools=tools_named("f", "memory"), messages=history,
                   context_management=clear_tool_uses(trigger=TRIGGER_LOW, keep=keep_none,
                                                      exclude_tools=["memory"]))
    assert message.context_management.applied_edits[0].cleared_tool_uses == 2
    # Clearing would free 2 x 992 tokens, less than the 2,000 asked: nothing is cleared.
    held = beta(sdk, tools=tools_named("f", "memory"), messages=history,
                context_management=clear_tool_uses(
                    trigger=TRIGGER_LOW, keep=keep_none, exclude_tools=["memory"],
                    clear_at_least={"type": "input_tokens", "value": 2_000}))
    assert held.context_management is None
    assert held.usage.input_tokens == message.usage.input_tokens + 2 * 992


def test_clear_tool_inputs_clears_the_calls_inputs_too(sdk: anthropic.Anthropic) -> None:
    rule = {"trigger": TRIGGER_LOW, "keep": {"type": "tool_uses", "value": 0}}
    results_only = beta(sdk, tools=tools_named("f"), messages=tool_history(1),
                        context_management=clear_tool_uses(**rule))
    with_inputs = beta(sdk, tools=tools_named("f"), messages=tool_history(1),
                       context_management=clear_tool_uses(**rule, clear_tool_inputs=True))
    # The input {"q": 40 x's}: "f" + {"q":"xx..."} = 1 + 48 bytes -> 13 tokens; "f" + {}: 1.
    assert (with_inputs.context_management.applied_edits[0].cleared_input_tokens
            - results_only.context_management.applied_edits[0].cleared_input_tokens) == 12


# -- clear_thinking_20251015 -------------------------------------------------------------------


def thinking_history() -> Any:
    """Two finished turns, each with 400 bytes (100 tokens) of thinking, then a question."""
    turn: list[dict[str, Any]] = []
    for word in ("one", "two"):
        turn += [{"role": "user", "content": word},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": "t" * 400, "signature": "sig"},
                     {"type": "text", "text": "ok"}]}]
    return [*turn, {"role": "user", "content": "three"}]


THINKING_ON: Any = {"thinking": {"type": "enabled", "budget_tokens": 1_024}, "max_tokens": 2_000}


def test_clear_thinking_keeps_the_last_turns_thinking_on_a_model_that_keeps_it_all(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    whole = beta(sdk, model=OPUS_45, messages=thinking_history(), **THINKING_ON)
    kept = beta(sdk, model=OPUS_45, messages=thinking_history(), **THINKING_ON,
                context_management={"edits": [{"type": "clear_thinking_20251015",
                                               "keep": {"type": "thinking_turns",
                                                        "value": 1}}]})
    edit = kept.context_management.applied_edits[0]
    assert (edit.type, edit.cleared_thinking_turns, edit.cleared_input_tokens) == (
        "clear_thinking_20251015", 1, 100)
    assert kept.usage.input_tokens == whole.usage.input_tokens - 100
    assert last_call(http).beyond_body == {"cleared_thinking_input_tokens": 100}


def test_keep_all_bills_every_turns_thinking_where_the_api_would_drop_it(
    sdk: anthropic.Anthropic
) -> None:
    # Sonnet 4.5 drops earlier turns' thinking by default; keep "all" keeps (and bills) both.
    default = beta(sdk, messages=thinking_history(), **THINKING_ON)
    kept = beta(sdk, messages=thinking_history(), **THINKING_ON,
                context_management={"edits": [{"type": "clear_thinking_20251015",
                                               "keep": "all"}]})
    assert kept.usage.input_tokens == default.usage.input_tokens + 200
    assert kept.context_management is None


# -- compaction (compact_20260112) -------------------------------------------------------------

# 200,000 bytes of user text: 50,000 tokens, + 4 + 3 = 50,007, above a 50,000-token trigger.
BIG: Any = [{"role": "user", "content": "x" * 200_000}]
BIG_TOKENS = 50_007
COMPACT: Any = {"edits": [{"type": "compact_20260112",
                      "trigger": {"type": "input_tokens", "value": 50_000}}]}
# The summary: 1,000 of the stub's words (100 rounds of ten words, 51 letters a round) and 999
# spaces, 6,099 bytes -> 1,525 tokens; the answer reads it as an assistant message: 4 + 1,525 + 3.
SUMMARY_TOKENS = 1_525
AFTER_COMPACTION_TOKENS = 1_532
# The summarizing step reads the whole input and its default prompt (the stub's 200 tokens).
COMPACTION_INPUT = BIG_TOKENS + 200
COMPACTION_OUTPUT = 1_000


def test_compaction_bills_the_summarizing_step_and_answers_from_the_summary(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    message = beta(sdk, model=OPUS_55, messages=BIG, context_management=COMPACT,
                   betas=["compact-2026-01-12"])
    assert [b.type for b in message.content] == ["compaction", "text"]
    assert message.content[0].content.startswith("the ceiling holds")
    assert message.usage.input_tokens == AFTER_COMPACTION_TOKENS
    assert [(i.type, i.input_tokens, i.output_tokens) for i in message.usage.iterations] == [
        ("compaction", COMPACTION_INPUT, COMPACTION_OUTPUT),
        ("message", AFTER_COMPACTION_TOKENS, 10)]
    call = last_call(http)
    assert call.beyond_body == {"compaction_input_tokens": COMPACTION_INPUT,
                                "compaction_output_tokens": COMPACTION_OUTPUT}
    # $4 / $20 a million: (50,207 + 1,532) x 4 + (1,000 + 10) x 20.
    assert call.cost_micros == 227_156


def test_a_paused_compaction_answers_the_summary_alone(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    paused = {"edits": [{**COMPACT["edits"][0], "pause_after_compaction": True}]}
    message = beta(sdk, model=OPUS_55, messages=BIG, context_management=paused,
                   betas=["compact-2026-01-12"])
    assert ([b.type for b in message.content], message.stop_reason) == (
        ["compaction"], "compaction")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (0, 0)
    assert last_call(http).cost_micros == COMPACTION_INPUT * 4 + COMPACTION_OUTPUT * 20


def test_what_precedes_a_compaction_block_sent_back_is_dropped_unbilled(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    first = beta(sdk, model=OPUS_55, messages=BIG, context_management=COMPACT,
                 betas=["compact-2026-01-12"])
    later = [*BIG, {"role": "assistant", "content": [first.content[0].to_dict()]},
             {"role": "user", "content": "go on"}]
    message = beta(sdk, model=OPUS_55, messages=later, context_management=COMPACT,
                   betas=["compact-2026-01-12"])
    # 4 + 1,525 for the summary, 4 + 2 for "go on", 3 for the reply; the 50,004 before it go.
    assert message.usage.input_tokens == 4 + SUMMARY_TOKENS + 4 + 2 + 3
    assert last_call(http).beyond_body == {"compaction_dropped_input_tokens": 50_004}


def test_a_streamed_compaction_arrives_in_the_sdks_stream(sdk: anthropic.Anthropic) -> None:
    message: Any
    with sdk.beta.messages.stream(model=OPUS_55, max_tokens=100, messages=BIG,
                                  context_management=COMPACT, betas=["compact-2026-01-12"],
                                  extra_headers=forced(10)) as stream:
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["compaction", "text"]
    assert message.content[0].content.startswith("the ceiling holds")
    assert message.usage.iterations[0].input_tokens == COMPACTION_INPUT


# -- output_config: structured outputs and effort ----------------------------------------------


class Person(pydantic.BaseModel):
    name: str
    age: int
    tags: list[str]
    kind: str
    born: str


PERSON_SCHEMA: Any = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "tags", "kind", "born"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 3},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "kind": {"enum": ["a", "b"]}, "born": {"type": "string", "format": "date"},
                   "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
PERSON = {"name": "", "age": 3, "tags": [], "kind": "a", "born": "2026-01-01"}


def test_structured_output_answers_json_the_sdk_parses(sdk: anthropic.Anthropic) -> None:
    parsed = sdk.messages.parse(model=SONNET, max_tokens=100, output_format=Person,
                                messages=[{"role": "user", "content": "who?"}])
    assert isinstance(parsed.parsed_output, Person)


def test_a_json_schema_format_answers_a_minimal_valid_instance_billed_as_written(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    message = sdk.messages.create(
        model=SONNET, max_tokens=100, messages=[{"role": "user", "content": "who?"}],
        output_config={"format": {"type": "json_schema", "schema": PERSON_SCHEMA}})
    text = message.content[0].text  # type: ignore[union-attr]
    assert json.loads(text) == PERSON
    # {"name":"","age":3,"tags":[],"kind":"a","born":"2026-01-01"}: 60 bytes -> 15 tokens.
    assert len(text.encode()) == 60
    assert message.usage.output_tokens == 15
    # The format's prompt is billed as its schema's JSON: "who?" is 4 + 1 + 3 = 8 without it.
    schema_bytes = len(json.dumps(PERSON_SCHEMA, separators=(",", ":")).encode())
    assert message.usage.input_tokens == 8 + -(-schema_bytes // 4)
    assert last_call(http).beyond_body == {"output_format_prompt_tokens": -(-schema_bytes // 4)}


def test_the_older_output_format_beta_shape_answers_the_same(sdk: anthropic.Anthropic) -> None:
    message: Any = sdk.beta.messages.create(
        model=SONNET, max_tokens=100, messages=[{"role": "user", "content": "who?"}],
        betas=["structured-outputs-2025-11-13"],
        extra_body={"output_format": {"type": "json_schema", "schema": PERSON_SCHEMA}})
    assert json.loads(message.content[0].text) == PERSON


def test_a_strict_tools_call_input_fits_its_schema(sdk: anthropic.Anthropic) -> None:
    tool: Any = {"name": "lookup", "strict": True, "input_schema": PERSON_SCHEMA,
            "input_examples": [PERSON], "eager_input_streaming": True,
            "cache_control": {"type": "ephemeral"}}
    message = sdk.beta.messages.create(
        model=SONNET, max_tokens=100, messages=[{"role": "user", "content": "who?"}],
        tools=[tool], tool_choice={"type": "tool", "name": "lookup"},
        betas=["structured-outputs-2025-11-13", "advanced-tool-use-2025-11-20"])
    call: Any = message.content[0]
    assert (call.type, call.name, call.input) == ("tool_use", "lookup", PERSON)


def test_effort_and_adaptive_thinking_set_the_thinking_share(
    sdk: anthropic.Anthropic
) -> None:
    shares = {}
    for effort in ("low", "medium", "high", "max"):
        message = beta(sdk, 100, model=OPUS_55, max_tokens=1_000,
                       thinking={"type": "adaptive", "display": "omitted"},
                       output_config={"effort": effort}, betas=["effort-2025-11-24"])
        assert message.content[0].type == "thinking"
        assert message.content[0].thinking == ""
        shares[effort] = message.usage.output_tokens_details.thinking_tokens
    assert shares == {"low": 25, "medium": 50, "high": 75, "max": 87}


# -- what Claude Code sends --------------------------------------------------------------------


def test_claude_codes_request_shape_is_served_and_billed(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    user_id = json.dumps({"device_id": "e" * 64, "account_uuid": "",
                          "session_id": "284d8588-797f-47db-adcb-4a85b72d6a39"})
    assert len(user_id) > 128
    deferred = {"name": "Later", "description": "not loaded", "defer_loading": True,
                "input_schema": {"type": "object", "properties": {}}}
    body: dict[str, Any] = {
        "model": OPUS_55, "max_tokens": 128_000,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                   {"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral", "ttl": "1h", "scope": "global"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "say hi"}]},
                     {"role": "system", "content": [{"type": "text", "text": "# Environment"}],
                      "output_config": {"effort": "medium"}}],
        "tools": tools_named("Bash"),
        "metadata": {"user_id": user_id},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"}, "stream": True,
    }
    headers = {"anthropic-beta": ",".join(CLAUDE_CODE_BETAS), **forced(10)}
    for tools in (body["tools"], [*body["tools"], deferred]):
        _, clean = sse_data(http, "/v1/messages?beta=true", {**body, "tools": tools}, headers)
        assert clean
    # A deferred tool is not in the prompt until a tool search loads it: it bills nothing.
    first, second = list(bill_of(http).log)[-2:]
    assert first.usage == second.usage
    assert first.billed


def test_a_tool_reference_loads_a_deferred_tools_definition_into_the_bill(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    # What Claude Code's ToolSearch answers: a tool_reference to a deferred tool.
    deferred = {"name": "WebFetch", "defer_loading": True, "input_schema": {"type": "object"}}
    search: Any = [*tools_named("ToolSearch"), deferred]
    call = {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}
    history: Any = [{"role": "user", "content": "find"},
                    {"role": "assistant", "content": [call]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                  "content": [{"type": "tool_reference",
                                                               "tool_name": "WebFetch"}]}]}]
    loaded = beta(sdk, tools=search, messages=history, betas=["advanced-tool-use-2025-11-20"])
    # {"name":"WebFetch","defer_loading":true,"input_schema":{"type":"object"}}: 73 bytes -> 19.
    assert last_call(http).beyond_body == {"loaded_tool_input_tokens": 19}
    history[2]["content"][0]["content"] = []
    unloaded = beta(sdk, tools=search, messages=history, betas=["advanced-tool-use-2025-11-20"])
    assert loaded.usage.input_tokens == unloaded.usage.input_tokens + 19


def test_web_fetches_bill_their_pages_as_input_up_to_max_uses(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    fetch = {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 2,
             "max_content_tokens": 500}
    ask: Any = [{"role": "user", "content": "read"}]
    idle = beta(sdk, messages=ask, tools=[fetch])
    message = sdk.beta.messages.create(
        model=SONNET, max_tokens=100, messages=ask, tools=[fetch], betas=[CONTEXT_BETA],
        extra_headers={**forced(10), "X-Stub-Web-Fetches": "3"})
    # Two pages of 500 tokens each; the third is refused by max_uses and bills nothing.
    assert [b.type for b in message.content][:6] == ["server_tool_use", "web_fetch_tool_result"] * 3
    assert message.content[5].content.type == "web_fetch_tool_result_error"
    assert message.usage.server_tool_use.web_fetch_requests == 2
    assert message.usage.input_tokens == idle.usage.input_tokens + 1_000
    assert last_call(http).beyond_body == {"web_fetch_content_tokens": 1_000}
    # Sent back, the pages count again as input, with the calls that fetched them.
    later = beta(sdk, tools=[fetch], messages=[*ask, {"role": "assistant", "content": [
        b.to_dict() for b in message.content]}, {"role": "user", "content": "more"}])
    # The assistant message: 4; each call "web_fetch" + {"url":"https://fetch.stub.invalid/
    # srvtoolu_<24 hex>"}: 9 + 70 bytes -> 20, three of them; the two pages, 500 each; the
    # answer's ten words, 60 bytes -> 15. Then "more": 4 + 1.
    assert later.usage.input_tokens == idle.usage.input_tokens + 4 + 3 * 20 + 1_000 + 15 + 5


@pytest.mark.parametrize("thinking", [
    {"type": "enabled", "budget_tokens": 31_999, "display": "omitted"},  # Claude Code, Sonnet 4.5
    {"type": "adaptive"}, {"type": "between_tools"}, {"type": "disabled"}])
def test_each_thinking_mode_claude_code_and_the_sdks_send_is_served(
    sdk: anthropic.Anthropic, thinking: Any
) -> None:
    message = beta(sdk, 40, max_tokens=32_000, thinking=thinking,
                   betas=["interleaved-thinking-2025-05-14"])
    kinds = [b.type for b in message.content]
    assert kinds == (["text"] if thinking["type"] == "disabled" else ["thinking", "text"])


def test_a_web_fetch_tool_with_max_uses_bills_its_definition_only(
    sdk: anthropic.Anthropic
) -> None:
    fetch = {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 2}
    without = beta(sdk, messages=[{"role": "user", "content": "read"}])
    message = beta(sdk, messages=[{"role": "user", "content": "read"}], tools=[fetch],
                   betas=["web-fetch-2025-09-10"])
    # {"type":"web_fetch_20250910","name":"web_fetch","max_uses":2}: 61 bytes -> 16 tokens, and
    # the tool-use system prompt (346 tokens under auto).
    assert message.usage.input_tokens == without.usage.input_tokens + 16 + 346
    assert message.usage.server_tool_use.web_fetch_requests == 0


# -- scripted tool calls (/control's tool_calls) -----------------------------------------------


WEATHER: Any = [{"name": "get_weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def test_a_scripted_tool_call_answers_once_then_the_tool_result_gets_text(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    http.post("/control", json={"tool_calls": [
        {"name": "get_weather", "input": {"city": "Paris"}},
        {"name": "elsewhere", "arguments": '{"a": 1}'}]}).raise_for_status()
    ask: Any = [{"role": "user", "content": "weather?"}]
    with sdk.messages.stream(model=OPUS_55, max_tokens=2_000, messages=ask, tools=WEATHER,
                             thinking={"type": "adaptive"}, extra_headers=forced(40)) as stream:
        first = stream.get_final_message()
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    call = first.content[1]
    assert (call.name, call.input, first.stop_reason) == (  # type: ignore[union-attr]
        "get_weather", {"city": "Paris"}, "tool_use")
    # The entry for a tool this call did not have stays queued.
    assert http.get("/control").json()["tool_calls"] == [{"name": "elsewhere",
                                                          "input": {"a": 1}}]
    result: Any = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,  # type: ignore[union-attr]
                                                "content": "sunny"}]}
    second = sdk.messages.create(model=OPUS_55, max_tokens=2_000, tools=WEATHER,
                                 messages=[*ask, first.to_param(), result],
                                 thinking={"type": "adaptive"}, extra_headers=forced(40))
    assert [b.type for b in second.content] == ["thinking", "text"]
    assert second.stop_reason == "end_turn"
    # The tool input's output tokens: {"city":"Paris"} is 16 bytes -> 4, after 20 of thinking.
    assert first.usage.output_tokens == 24


def test_a_scripted_tool_call_streams_in_anthropics_event_sequence(http: httpx.Client) -> None:
    http.post("/control", json={"tool_calls": [{"name": "get_weather",
                                                "input": {"city": "x" * 100}}]}
              ).raise_for_status()
    events, clean = sse_data(http, "/v1/messages", {
        "model": OPUS_55, "max_tokens": 2_000, "stream": True, "tools": WEATHER,
        "thinking": {"type": "enabled", "budget_tokens": 1_024},
        "messages": [{"role": "user", "content": "weather?"}]}, forced(40))
    assert clean
    kinds = [(e["type"], e.get("delta", {}).get("type") or e.get("content_block", {}).get("type"))
             for e in events]
    deltas = [k for k in kinds if k[0] == "content_block_delta"]
    assert kinds[0] == ("message_start", None)
    assert kinds[-2:] == [
        ("message_delta", None), ("message_stop", None)]
    assert ("content_block_start", "thinking") in kinds
    assert (
        "content_block_start", "tool_use") in kinds
    assert {"thinking_delta", "signature_delta", "input_json_delta"} <= {d[1] for d in deltas}
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e.get("delta", {}).get("type") == "input_json_delta")
    assert json.loads(partial) == {"city": "x" * 100}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_control_refuses_a_malformed_tool_call(http: httpx.Client) -> None:
    for bad in ([{"name": "f"}], [{"name": "f", "input": [1]}],
                [{"name": "f", "arguments": "{nope"}], "f"):
        assert http.post("/control", json={"tool_calls": bad}).status_code == 400


# -- count_tokens ------------------------------------------------------------------------------


def test_count_tokens_takes_the_new_fields_counts_after_edits_and_bills_nothing(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    counted: Any = sdk.beta.messages.count_tokens(
        model=OPUS_55, messages=tool_history(5), tools=tools_named("f"),
        thinking={"type": "adaptive"}, output_config={"effort": "low"},
        context_management=clear_tool_uses(trigger=TRIGGER_LOW,
                                           keep={"type": "tool_uses", "value": 2}),
        betas=[CONTEXT_BETA, "effort-2025-11-24"])
    assert counted.context_management.original_input_tokens - counted.input_tokens == 2_976
    bill = bill_of(http)
    assert bill.total.calls == 0
    assert bill.log[-1].status == 200
    message = beta(sdk, model=OPUS_55, messages=tool_history(5), tools=tools_named("f"),
                   context_management=clear_tool_uses(trigger=TRIGGER_LOW,
                                                      keep={"type": "tool_uses", "value": 2}))
    assert message.usage.input_tokens == counted.input_tokens
    assert last_call(http).billed


# -- the JSON-schema instances structured outputs answer with -----------------------------------


@pytest.mark.parametrize(("schema", "instance"), [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
      "$defs": {"A": {"type": "object", "properties": {"n": {"type": "number"}},
                      "required": ["n"]}}}, {"a": {"n": 0}}),
    ({"anyOf": [{"type": "null"}, {"type": "string"}]}, None),
    ({"type": ["null", "integer"], "exclusiveMinimum": 4}, 5),
    ({"type": "array", "items": {"const": "k"}, "minItems": 2}, ["k", "k"]),
    ({"type": "string", "minLength": 3}, "xxx"),
    ({"type": "string", "format": "uuid"}, "00000000-0000-4000-8000-000000000000"),
    ({"type": "boolean"}, False),
    ({"enum": [7, 8]}, 7),
])
def test_schema_instances_are_minimal_and_valid(schema: Any, instance: Any) -> None:
    assert schema_instance(schema) == instance


# -- system messages (per-turn-control, mid-conversation-tool-changes) -------------------------


def test_a_system_message_cleared_at_the_next_user_message_stops_billing(
    sdk: anthropic.Anthropic
) -> None:
    note = {"role": "system", "content": "n" * 400, "clear_at": "next_user_message"}
    turn: Any = [{"role": "user", "content": "one"}, note]
    shown = beta(sdk, messages=turn, betas=["per-turn-control-2026-07-01"])
    gone = beta(sdk, messages=[*turn, {"role": "assistant", "content": "ok"},
                               {"role": "user", "content": "two"}],
                betas=["per-turn-control-2026-07-01"])
    # "one" and the note: 4 + 1 + 4 + 100 + 3; later the note goes: 4 + 1 + 4 + 1 + 4 + 1 + 3.
    assert (shown.usage.input_tokens, gone.usage.input_tokens) == (112, 18)


def test_a_tool_added_mid_conversation_bills_its_definition(sdk: anthropic.Anthropic) -> None:
    added = {"name": "g", "input_schema": {"type": "object"}}  # 45 bytes -> 12 tokens
    messages: Any = [{"role": "user", "content": "one"},
                     {"role": "system", "content": [{"type": "tool_addition", "tool": added}]}]
    message = beta(sdk, messages=messages, betas=["mid-conversation-tool-changes-2026-07-01"])
    assert message.usage.input_tokens == 4 + 1 + 4 + 12 + 3


# -- what a body refers to but does not hold ----------------------------------------------------


def test_omitted_thinking_sent_back_bills_the_whole_thinking_its_signature_carries(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    # Claude Code's shape: adaptive thinking, display omitted, every turn's thinking kept.
    thinking: Any = {"type": "adaptive", "display": "omitted"}
    keep_all: Any = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    ask: Any = [{"role": "user", "content": "plan"}]
    first = beta(sdk, 400, model=OPUS_55, max_tokens=1_000, messages=ask, thinking=thinking,
                 context_management=keep_all)
    block = first.content[0]
    assert (block.type, block.thinking) == ("thinking", "")
    billed = first.usage.output_tokens_details.thinking_tokens
    assert billed == 200  # half of 400, at the default effort
    later: Any = [*ask, {"role": "assistant", "content": [b.to_dict() for b in first.content]},
                  {"role": "user", "content": "go"}]
    sent = beta(sdk, model=OPUS_55, max_tokens=1_000, messages=later, thinking=thinking,
                context_management=keep_all)
    assert last_call(http).beyond_body == {"signed_thinking_input_tokens": billed}
    # A signature not the stub's carries nothing the stub knows of: the block is billed by its
    # text alone (here empty).
    later[1]["content"][0]["signature"] = "forged"
    forged = beta(sdk, model=OPUS_55, max_tokens=1_000, messages=later, thinking=thinking,
                  context_management=keep_all)
    assert sent.usage.input_tokens - forged.usage.input_tokens == billed


def test_count_tokens_counts_the_input_compaction_would_summarize(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    counted: Any = sdk.beta.messages.count_tokens(model=OPUS_55, messages=BIG,
                                                  context_management=COMPACT,
                                                  betas=["compact-2026-01-12"])
    assert counted.input_tokens == BIG_TOKENS
    assert bill_of(http).total.calls == 0


def test_fast_mode_bills_the_fast_rates_where_the_model_has_them(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    message = beta(sdk, 100, model=OPUS_55, max_tokens=200, speed="fast",
                   betas=["fast-mode-2026-02-01"])
    assert message.usage.speed == "fast"
    # Opus 5.5 fast: $8 / $40 a million (2x); "hello" is 9 tokens in, 100 out: 72 + 4,000.
    call = last_call(http)
    assert (call.cost_micros, call.service_tier) == (4_072, "fast")
    with pytest.raises(anthropic.BadRequestError, match="fast mode is not supported"):
        beta(sdk, model=SONNET, speed="fast", betas=["fast-mode-2026-02-01"])
