"""What agents send the stub's Responses route, and the tool calls /control scripts for their
tests: served as OpenAI serves them, streamed in OpenAI's event order, each event parsed by the
real `openai` SDK into its own type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel

from infra.stub_bill import Bill
from infra.stub_provider import StubProvider
from tests.infra.conftest import start_fresh

# A namespace tool holding function tools, as Codex CLI sends one (codex-rs: ToolSpec::Namespace,
# ResponsesApiNamespace {name, description, tools: [function...]}, serialized with "type").
NAMESPACE_TOOL: Any = {
    "type": "namespace", "name": "mcp__files__", "description": "Tools in the files namespace.",
    "tools": [{"type": "function", "name": "read_file", "description": "Read a file.",
               "strict": False, "parameters": {"type": "object", "properties": {
                   "path": {"type": "string"}}, "required": ["path"]}}],
}
SHELL_TOOL: Any = {
    "type": "function", "name": "shell", "description": "Run a command.", "strict": False,
    "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {
        "type": "string"}}}, "required": ["command"]}}
# What Codex CLI sends besides its input (codex-rs: ResponsesApiRequest), all taken.
CODEX_FIELDS: Any = {
    "instructions": "You are a coding agent.", "tool_choice": "auto",
    "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199-session", "text": {"verbosity": "low"},
    "client_metadata": {"originator": "codex_exec"}, "stream_options": {
        "include_obfuscation": False},
}


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=5, latency_ms_min=0, latency_ms_max=2) as stub:
        yield stub


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"tool_calls": []})


def script(http: httpx.Client, *calls: dict[str, Any]) -> None:
    http.post("/control", json={"tool_calls": list(calls)}).raise_for_status()


def typed(events: list[ResponseStreamEvent]) -> list[str]:
    """The events' types, each checked to have parsed into the SDK's own class for it."""
    for event in events:
        assert type(event).__module__.startswith("openai.types.responses."), event
    return [e.type for e in events]


def test_a_scripted_call_in_a_namespace_streams_in_openais_order(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    script(http, {"name": "read_file", "arguments": {"path": "README.md"}})
    body = {**CODEX_FIELDS, "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "read the readme"}]}],
        "tools": [SHELL_TOOL, NAMESPACE_TOOL, {"type": "web_search"}], "max_tool_calls": 0}
    fields = {k: v for k, v in body.items() if k not in ("client_metadata", "stream")}
    events = list(sdk.responses.create(model="gpt-5.1-codex", stream=True, **fields,
                                       extra_body={"client_metadata": body["client_metadata"]},
                                       extra_headers={"X-Stub-Reasoning-Tokens": "12"}))
    assert typed(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    reasoning, call = final.output
    assert reasoning.type == "reasoning"
    assert reasoning.encrypted_content
    assert call.type == "function_call"
    assert (call.name, call.namespace, json.loads(call.arguments)) == (
        "read_file", "mcp__files__", {"path": "README.md"})
    assert final.usage.output_tokens_details.reasoning_tokens == 12
    assert final.usage.input_tokens_details.cached_tokens == 0
    # The next call holds the tool's output (and sends the reasoning back): a text answer.
    follow_up = sdk.responses.create(model="gpt-5.1-codex", store=False, tools=[NAMESPACE_TOOL],
                                     input=[
        reasoning.model_dump(exclude_none=True),
        {"type": "function_call", "call_id": call.call_id, "name": "read_file",
         "namespace": "mcp__files__", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "# spend-ceiling"},
    ])
    assert [item.type for item in follow_up.output] == ["reasoning", "message"]
    assert follow_up.output_text


def test_the_tools_and_items_codex_sends_are_taken_and_billed(
    http: httpx.Client,
) -> None:
    tools = [NAMESPACE_TOOL, {"type": "local_shell"},
             {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
             {"type": "web_search", "external_web_access": False}]
    shell_call = {"type": "local_shell_call", "call_id": "c1", "status": "completed",
                  "action": {"type": "exec", "command": ["ls"]}}
    items = [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "be careful"}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "weather"}},
        shell_call, {"type": "function_call_output", "call_id": "c1", "output": "README.md"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "+x"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
    ]
    answer = http.post("/v1/responses", headers={"X-Stub-Output-Tokens": "5"}, json={
        **{k: v for k, v in CODEX_FIELDS.items() if k != "stream"}, "model": "gpt-5-codex",
        "tools": tools, "input": items, "max_tool_calls": 0})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    # Each item's text and 4 for it: "be careful" 3; "weather" 2; the shell call by its JSON
    # text; "README.md" 3; "apply_patch" + "+x" 4; "done" 1; the tools by their JSON; the
    # instructions "You are a coding agent." 6 + 4; the reply 3.
    shell_tokens = -(-len(json.dumps(shell_call, separators=(",", ":")).encode()) // 4)
    tools_tokens = -(-len(json.dumps(tools, separators=(",", ":")).encode()) // 4)
    assert usage["input_tokens"] == (3 + 2 + shell_tokens + 3 + 4 + 1 + 6 * 4 + tools_tokens
                                     + 6 + 4 + 3)


def test_the_sdks_stream_helper_assembles_the_scripted_call(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    script(http, {"name": "shell", "arguments": '{"command": ["ls"]}'})
    with sdk.responses.stream(model="gpt-5", input="list files", tools=[SHELL_TOOL],
                              reasoning={"effort": "low"}) as stream:
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert (call.name, call.arguments) == ("shell", '{"command": ["ls"]}')


def test_a_scripted_call_waits_for_a_call_that_offers_its_tool(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    script(http, {"name": "shell", "arguments": {"command": ["ls"]}},
           {"name": "read_file", "arguments": {"path": "a"}})
    plain = sdk.responses.create(model="gpt-4o", input="hello", max_output_tokens=20)
    assert [item.type for item in plain.output] == ["message"]
    # Only read_file is offered: the first entry that matches is taken, shell's stays queued.
    first = sdk.responses.create(model="gpt-4o", input="hello", tools=[NAMESPACE_TOOL])
    assert first.output[0].type == "function_call"
    assert first.output[0].name == "read_file"
    second = sdk.responses.create(model="gpt-4o", input="hello", tools=[SHELL_TOOL])
    assert second.output[0].type == "function_call"
    assert second.output[0].name == "shell"
    third = sdk.responses.create(model="gpt-4o", input="hello", tools=[SHELL_TOOL],
                                 max_output_tokens=20)
    assert third.output[0].type == "message"
    assert http.get("/control").json()["tool_calls"] == []


def test_chat_answers_a_scripted_call_too(sdk: openai.OpenAI, http: httpx.Client) -> None:
    script(http, {"name": "lookup", "arguments": {"q": "weather"}})
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    chunks = list(sdk.chat.completions.create(
        model="gpt-4o", stream=True, stream_options={"include_usage": True}, tools=tools,
        messages=[{"role": "user", "content": "weather?"}]))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and
             c.choices[0].delta.tool_calls]
    [[call]] = calls
    assert call.function is not None
    assert (call.function.name, json.loads(call.function.arguments or "")) == (
        "lookup", {"q": "weather"})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # The output billed is the arguments' text: '{"q": "weather"}' 16 bytes, 4 tokens.
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


@pytest.mark.parametrize("calls", [
    [{"arguments": {}}], [{"name": ""}], [{"name": "x", "arguments": "{not json"}],
    [{"name": "x", "extra": 1}], {"name": "x"},
])
def test_the_control_route_refuses_a_malformed_script(http: httpx.Client, calls: Any) -> None:
    assert http.post("/control", json={"tool_calls": calls}).status_code == 400
    assert http.get("/control").json()["tool_calls"] == []


def test_the_bill_shows_what_each_call_was_billed_beyond_its_body(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    first = sdk.responses.create(model="gpt-5", input="hello",
                                 extra_headers={"X-Stub-Output-Tokens": "20",
                                                "X-Stub-Reasoning-Tokens": "10"})
    sdk.responses.create(model="gpt-5", input="hello", previous_response_id=first.id,
                         tools=[{"type": "web_search"}], max_tool_calls=1)
    entry = http.get("/billing").json()["log"][-1]["usage"]
    assert entry["referenced_input_tokens"] == 9 + 20
    assert (entry["web_search_tool_calls"], entry["web_search_content_tokens"]) == (1, 8_000)
    bill = Bill.from_json(http.get("/billing").json())
    assert (bill.total.referenced_input_tokens, bill.total.web_search_tool_calls) == (29, 1)


class Place(BaseModel):
    city: str
    population: int
    tags: list[str]
    kind: Literal["town", "city"]
    note: str | None


class Answer(BaseModel):
    places: list[Place]
    best: Place
    sure: bool


def test_a_structured_answer_is_a_document_of_its_schema_on_both_routes(
    sdk: openai.OpenAI, http: httpx.Client
) -> None:
    parsed = sdk.responses.parse(model="gpt-5-mini", input="where?", text_format=Answer)
    assert parsed.output_parsed is not None
    assert parsed.output_parsed.best.kind == "town"
    streamed = "".join(e.delta for e in sdk.responses.create(
        model="gpt-4o", input="where?", stream=True,
        text={"format": {"type": "json_object"}}) if e.type == "response.output_text.delta")
    assert json.loads(streamed) == {}
    chat = sdk.chat.completions.parse(model="gpt-4o", response_format=Answer,
                                      messages=[{"role": "user", "content": "where?"}])
    assert chat.choices[0].message.parsed == parsed.output_parsed
    # The answer's text is its output, 4 bytes a token.
    text = chat.choices[0].message.content or ""
    assert chat.usage is not None
    assert chat.usage.completion_tokens == -(-len(text.encode()) // 4)
    # At the cap, the document is cut off there, as OpenAI's is.
    cut = sdk.responses.create(model="gpt-4o", input="where?", max_output_tokens=5,
                               text={"format": {"type": "json_schema", "name": "answer",
                                                "schema": Answer.model_json_schema()}})
    assert (cut.status, len(cut.output_text)) == ("incomplete", 20)


def test_a_forced_call_without_a_script_gives_arguments_of_the_functions_schema(
    sdk: openai.OpenAI,
) -> None:
    forced = sdk.responses.create(model="gpt-4o", input="read", tools=[NAMESPACE_TOOL],
                                  tool_choice="required", max_output_tokens=50)
    [call] = forced.output
    assert call.type == "function_call"
    assert (call.name, call.namespace) == ("read_file", "mcp__files__")
    assert json.loads(call.arguments) == {"path": "the ceiling holds"}
    chat = sdk.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "run"}], tool_choice="required",
        tools=[{"type": "function", "function": {"name": "shell", "parameters": SHELL_TOOL[
            "parameters"]}}])
    [chat_call] = chat.choices[0].message.tool_calls or []
    assert chat_call.type == "function"
    assert json.loads(chat_call.function.arguments) == {"command": []}
