"""OpenAI's Responses API on the stub provider: POST /v1/responses, and /v1/conversations.

Streamed (`response.created` ... `response.completed`, or `response.incomplete` at the cap) and
not; one answer a call. What Responses has that chat has not: `instructions`, input items
(messages, function and custom tool calls and their outputs, reasoning items, web search calls,
`item_reference`; Codex CLI's shell and tool search calls), a JSON schema in `text.format`,
tools (function and custom, `namespace` tools holding them as Codex CLI sends, its `local_shell`
and `tool_search`, and the hosted `web_search` and `web_search_preview`), and what a call only
refers to, billed as input as OpenAI bills it:

- `previous_response_id`: a response stored (unless `store: false`) is billed again as input of
  the call that continues it: its input and its output, reasoning included (the witness's larger
  reading), so a chain carries everything before it.
- Reasoning: a reasoning model's answer starts with a `reasoning` item (`rs_...`, a summary when
  `reasoning.summary` asks) whose `encrypted_content` (always given, as the SDK documents it) is
  an authenticated encoding of the reasoning tokens billed. Sent back in a later input, with
  that content (under `store: false` too) or by its id (a stored response's item), those tokens
  are billed as input; content the stub did not issue is refused (400
  `invalid_encrypted_content`), as an id it does not hold is.
- `item_reference`: an item of a stored response (reasoning, message, function call, web search
  call), or an id the /control registry sizes.
- `conversation` (POST /v1/conversations): its items are input; the call's input and output are
  appended to it.
- `prompt` {id, version, variables}: a prompt /control registered (`prompts: {id: {"tokens":
  N}}`) is N tokens of input, its variables counted as the body's text or parts.
- Files and images by id or URL: sized from the registry (infra.stub_tokens).

Each is `referenced_input_tokens` in the bill. The whole input is held to the model's context
window (infra.stub_openai). Hosted web search: `X-Stub-Web-Searches` or /control `web_searches`
searches (1 by default, at most `max_tool_calls`), each billed the table's fee and its content as
input (infra.stub_openai), each a `web_search_call` output item. `background` and `n` are
refused. Billing: infra.stub_openai. The wire format follows OpenAI's API reference
(https://developers.openai.com/api/reference/resources/responses, streaming events:
.../responses/streaming-events; conversations: .../resources/conversations), checked against
the `openai` SDK in tests/infra/test_stub_provider.py and test_stub_responses_*.py.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infra.stub_faults import (
    REGISTRY_ENTRIES_MAX,
    ApiError,
    Fault,
    count,
    read_body,
    sse,
    words,
)
from infra.stub_openai import (
    Answer,
    Counter,
    OpenAIApi,
    Prompt,
    forced_tool,
    function_text,
    invalid,
    text_of,
)
from infra.stub_prices import ModelPrices
from infra.stub_tokens import (
    TOKENS_PER_MESSAGE,
    InputError,
    Registry,
    text_tokens,
)

# What the stub keeps of stored responses, their items and conversations is bounded, oldest out
# first: a long load run must not grow the stub without end.
RESPONSES_STORED_MAX = 10_000
ITEMS_STORED_MAX = 50_000
CONVERSATIONS_MAX = 1_000
CONVERSATION_ITEMS_MAX = 10_000
# OpenAI takes at most 20 items when a conversation is created or added to.
CONVERSATION_ITEMS_A_CALL_MAX = 20
# Tools the client runs itself; a namespace tool holds function and custom tools. Codex CLI
# offers `local_shell` and `tool_search` (run by the client too) as some of its configurations
# ask; they bill nothing but their definitions and calls.
CLIENT_TOOL_TYPES = frozenset({"function", "custom"})
CLIENT_RUN_TOOL_TYPES = CLIENT_TOOL_TYPES | {"local_shell", "tool_search"}
# Items of tools the client runs, sent back in later input: billed by their JSON text.
CLIENT_CALL_ITEM_TYPES = frozenset({"local_shell_call", "local_shell_call_output",
                                    "tool_search_call", "tool_search_output", "shell_call",
                                    "shell_call_output", "apply_patch_call",
                                    "apply_patch_call_output"})
# OpenAI's hosted web search, by the names Responses takes.
WEB_SEARCH_TYPES = frozenset({"web_search", "web_search_2025_08_26"})
WEB_SEARCH_PREVIEW_TYPES = frozenset({"web_search_preview", "web_search_preview_2025_03_11"})
# Searches a call with a web search tool runs when neither a header nor /control says.
WEB_SEARCHES_DEFAULT = 1
# The summary a reasoning item gives when `reasoning.summary` asks: at most this many words.
SUMMARY_WORDS_MAX = 12
# What encrypted reasoning content starts with (as OpenAI's does): the rest is the stub's own.
ENCRYPTED_PREFIX = "gAAAAA"
# What POST /control takes for this API besides the shared settings: stored prompts.
CONTROL_FIELDS = frozenset({"prompts"})


class ResponsesApi(OpenAIApi):
    name = "responses"
    id_prefix = "resp_"
    cap_fields = ("max_output_tokens",)
    stored: OrderedDict[str, int]  # response id -> its context's tokens
    items: OrderedDict[str, int]  # a stored response's item id -> its tokens as input
    conversations: OrderedDict[str, list[dict[str, Any]]]  # id -> its items, oldest first

    def reset(self) -> None:
        super().reset()
        self.stored = OrderedDict()
        self.items = OrderedDict()
        self.conversations = OrderedDict()
        # Encrypted reasoning is sealed with this key: content from before a reset is refused.
        self.key = secrets.token_bytes(32)

    # -- counting ------------------------------------------------------------------------------

    def prompt(self, body: dict[str, Any], prices: ModelPrices) -> Prompt:
        if body.get("background") not in (None, False):
            raise InputError("background is not served by the stub", "background")
        if body.get("n") is not None:
            raise InputError("n is not a Responses parameter", "n")
        include = body.get("include")
        if include is not None and (not isinstance(include, list)
                                    or not all(isinstance(i, str) for i in include)):
            raise InputError("include must be a list of strings", "include")
        previous = body.get("previous_response_id")
        conversation = self._conversation(body)
        if previous is not None and conversation is not None:
            raise InputError("previous_response_id and conversation cannot be used together",
                             "previous_response_id")
        if previous is not None and (not isinstance(previous, str) or previous not in self.stored):
            raise InputError(f"previous response {previous!r} not found", "previous_response_id")
        counter = ResponsesCounter(prices, self.app.registry, self)
        if previous is not None:
            tokens = self.stored[str(previous)]
            counter.refer(tokens)
            counter.segment({"previous_response_id": previous}, 0, tokens, framed=False)
        if conversation is not None:
            with counter.referring():
                for i, item in enumerate(self.conversations[conversation]):
                    _item(counter, item, f"conversation.items[{i}]")
        return responses_prompt(body, counter)

    def _conversation(self, body: dict[str, Any]) -> str | None:
        """The conversation a call names (an id, or an object with one), which must exist."""
        given = body.get("conversation")
        if given is None:
            return None
        conversation = given.get("id") if isinstance(given, dict) else given
        if not isinstance(conversation, str) or conversation not in self.conversations:
            raise InputError(f"conversation {conversation!r} not found", "conversation")
        return conversation

    def output_schema(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """`text.format`: a json_schema's schema, or any object for json_object."""
        text = body.get("text")
        form = text.get("format") if isinstance(text, dict) else None
        if not isinstance(form, dict) or form.get("type") not in ("json_schema", "json_object"):
            return None
        schema = form.get("schema")
        return schema if isinstance(schema, dict) else {"type": "object"}

    def effort(self, body: dict[str, Any]) -> object:
        reasoning = body.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, dict):
            raise invalid("reasoning must be an object", "reasoning")
        return None if reasoning is None else reasoning.get("effort")

    def web_searches(self, body: dict[str, Any], prices: ModelPrices,
                     fault: Fault) -> tuple[int, int]:
        """Searches of the hosted web search tool: (at its fee, at the preview's dearer fee).

        As many as the header or /control says (else one), at most `max_tool_calls`; none when
        `tool_choice` is "none" or forces a function. `web_search_preview` on a model that does
        not reason is billed the preview's fee with its content free; otherwise the fee a
        search plus the content (https://developers.openai.com/api/docs/pricing)."""
        tools = body.get("tools") or []
        kinds = {t.get("type") for t in tools if isinstance(t, dict)}
        searching = kinds & (WEB_SEARCH_TYPES | WEB_SEARCH_PREVIEW_TYPES)
        if not searching or body.get("tool_choice") == "none" or forced_tool(body):
            return 0, 0
        if self.app.prices.openai_tools is None:
            raise InputError("the stub's table prices no web search tool", "tools")
        searches = WEB_SEARCHES_DEFAULT if fault.web_searches is None else fault.web_searches
        limit = body.get("max_tool_calls")
        if limit is not None:
            if type(limit) is not int or limit < 0:
                raise InputError("max_tool_calls must be a non-negative integer",
                                 "max_tool_calls")
            searches = min(searches, limit)
        if not (searching & WEB_SEARCH_TYPES) and not prices.reasoning:
            return 0, searches
        return searches, 0

    # -- what billing leaves behind ------------------------------------------------------------

    def charged(self, decided: Answer, fault: Fault) -> None:
        super().charged(decided, fault)
        output = _items(decided, self.key)
        if decided.request.get("store", True) is not False:
            self.stored[decided.answer_id] = (decided.usage.input_tokens
                                              + decided.choices[0].output_tokens)
            _bounded(self.stored, RESPONSES_STORED_MAX)
            for item in output:
                self.items[item["id"]] = _item_tokens(decided, item)
            _bounded(self.items, ITEMS_STORED_MAX)
        conversation = decided.request.get("conversation")
        conversation = (conversation.get("id") if isinstance(conversation, dict)
                        else conversation)
        if isinstance(conversation, str) and conversation in self.conversations:
            given = decided.request.get("input")
            sent = [{"role": "user", "content": given}] if isinstance(given, str) else given
            self._append(conversation, [*(sent or []), *output])

    def _append(self, conversation: str, items: list[dict[str, Any]]) -> None:
        kept = self.conversations[conversation]
        kept.extend(items)
        # Oldest items out first: a conversation is held to what a walk of the input may hold.
        del kept[:max(0, len(kept) - CONVERSATION_ITEMS_MAX)]

    def reasoning_tokens(self, content: object, where: str) -> int:
        """The reasoning tokens a piece of encrypted content stands for, if the stub issued it."""
        refused = ApiError(400, f"The encrypted content for {where} could not be verified.",
                           "invalid_encrypted_content", param=where)
        if not isinstance(content, str) or not content.startswith(ENCRYPTED_PREFIX):
            raise refused
        try:
            raw = base64.urlsafe_b64decode(content.removeprefix(ENCRYPTED_PREFIX).encode())
        except ValueError as exc:
            raise refused from exc
        sealed, tag = raw[:-16], raw[-16:]
        if not hmac.compare_digest(tag, _seal(self.key, sealed)):
            raise refused
        return int(sealed.split(b":", 1)[0])

    def stored_item(self, item_id: object, where: str) -> int:
        """The tokens of an item of a stored response, as input."""
        tokens = self.items.get(str(item_id))
        if tokens is None:
            raise InputError(f"Item with id {item_id!r} not found. Items are not persisted "
                             "when `store` is set to false.", where)
        return tokens

    # -- /v1/conversations -----------------------------------------------------------------------

    def routes_conversations(self) -> list[tuple[str, Any, list[str]]]:
        return [("/v1/conversations", self.create_conversation, ["POST"]),
                ("/v1/conversations/{conversation_id}", self.get_conversation, ["GET"]),
                ("/v1/conversations/{conversation_id}/items", self.items_route,
                 ["GET", "POST"])]

    async def create_conversation(self, request: Request) -> Response:
        try:
            self.check(request)
            body = await read_body(request)
            items = _conversation_items(body.get("items", []))
        except ApiError as exc:
            return self.error(exc, {})
        conversation = "conv_" + secrets.token_hex(24)
        self.conversations[conversation] = items
        _bounded(self.conversations, CONVERSATIONS_MAX)
        return JSONResponse({"id": conversation, "object": "conversation",
                             "created_at": int(time.time()),
                             "metadata": body.get("metadata") or {}})

    def _known_conversation(self, request: Request) -> str:
        """The conversation the path names, once the request's key is checked; a 404, as
        OpenAI answers, when the stub holds none by that id."""
        conversation: str = request.path_params["conversation_id"]
        self.check(request)
        if conversation not in self.conversations:
            raise ApiError(404, f"Conversation with id '{conversation}' not found.",
                           "not_found")
        return conversation

    async def get_conversation(self, request: Request) -> Response:
        try:
            conversation = self._known_conversation(request)
        except ApiError as exc:
            return self.error(exc, {})
        return JSONResponse({"id": conversation, "object": "conversation",
                             "created_at": int(time.time()), "metadata": {}})

    async def items_route(self, request: Request) -> Response:
        """A conversation's items: listed (GET, all of them, newest first unless `order=asc`,
        as OpenAI lists them) or added (POST)."""
        try:
            conversation = self._known_conversation(request)
            if request.method == "GET":
                items = self.conversations[conversation]
                if request.query_params.get("order") != "asc":
                    items = items[::-1]
            else:
                items = _conversation_items((await read_body(request)).get("items"))
                self._append(conversation, items)
        except ApiError as exc:
            return self.error(exc, {})
        return JSONResponse({"object": "list", "data": items, "has_more": False,
                             "first_id": items[0]["id"] if items else None,
                             "last_id": items[-1]["id"] if items else None})

    # -- the wire ------------------------------------------------------------------------------

    def body(self, decided: Answer, *, final: bool = True) -> dict[str, Any]:
        """The response object; `final` False gives it as `response.created` shows it."""
        request = decided.request
        incomplete = decided.choices[0].finish_reason == "length"
        status = ("incomplete" if incomplete else "completed") if final else "in_progress"
        conversation = request.get("conversation")
        return {
            "id": decided.answer_id,
            "object": "response",
            "created_at": decided.created_s,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if final and incomplete
            else None,
            "instructions": request.get("instructions"),
            "max_output_tokens": request.get("max_output_tokens"),
            "max_tool_calls": request.get("max_tool_calls"),
            "model": decided.model,
            "output": _items(decided, self.key) if final else [],
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": request.get("previous_response_id"),
            "conversation": ({"id": conversation} if isinstance(conversation, str)
                             else conversation),
            "prompt": request.get("prompt"),
            "prompt_cache_key": request.get("prompt_cache_key"),
            "reasoning": request.get("reasoning") or {"effort": None, "summary": None},
            "service_tier": decided.service_tier,
            "store": request.get("store", True),
            "temperature": request.get("temperature", 1.0),
            "text": request.get("text") or {"format": {"type": "text"}},
            "tool_choice": request.get("tool_choice", "auto"),
            "tools": request.get("tools") or [],
            "top_p": request.get("top_p", 1.0),
            "truncation": request.get("truncation", "disabled"),
            "usage": _usage(decided) if final else None,
            "metadata": request.get("metadata") or {},
        }

    def events(self, decided: Answer, fault: Fault) -> list[bytes]:
        """Every SSE event of the stream, in OpenAI's order; the terminal `response.completed`
        (or `response.incomplete` when the cap was hit) last, carrying the usage."""
        events: list[bytes] = []

        def event(kind: str, **fields: Any) -> None:
            events.append(sse({"type": kind, "sequence_number": len(events), **fields}, kind))

        event("response.created", response=self.body(decided, final=False))
        event("response.in_progress", response=self.body(decided, final=False))
        choice = decided.choices[0]
        for index, item in enumerate(_items(decided, self.key)):
            at = {"item_id": item["id"], "output_index": index}
            if item["type"] == "message":
                opened = {**item, "status": "in_progress", "content": []}
                event("response.output_item.added", output_index=index, item=opened)
                empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                event("response.content_part.added", **at, content_index=0, part=empty)
                for piece, _ in choice.deltas():
                    event("response.output_text.delta", **at, content_index=0, delta=piece,
                          logprobs=[])
                event("response.output_text.done", **at, content_index=0, text=choice.text,
                      logprobs=[])
                event("response.content_part.done", **at, content_index=0,
                      part=item["content"][0])
            elif item["type"] == "function_call":
                event("response.output_item.added", output_index=index,
                      item={**item, "arguments": "", "status": "in_progress"})
                event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                event("response.function_call_arguments.done", **at,
                      arguments=item["arguments"])
            elif item["type"] == "reasoning":
                event("response.output_item.added", output_index=index,
                      item={"id": item["id"], "type": "reasoning", "summary": []})
                for s, part in enumerate(item["summary"]):
                    summary = {**at, "summary_index": s}
                    event("response.reasoning_summary_part.added", **summary,
                          part={"type": "summary_text", "text": ""})
                    event("response.reasoning_summary_text.delta", **summary,
                          delta=part["text"])
                    event("response.reasoning_summary_text.done", **summary, text=part["text"])
                    event("response.reasoning_summary_part.done", **summary, part=part)
            elif item["type"] == "web_search_call":
                event("response.output_item.added", output_index=index,
                      item={**item, "status": "in_progress"})
                for phase in ("in_progress", "searching", "completed"):
                    event(f"response.web_search_call.{phase}", **at)
            event("response.output_item.done", output_index=index, item=item)
        final = self.body(decided)
        event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
              response=final)
        return events


# -- counting ------------------------------------------------------------------------------------


class ResponsesCounter(Counter):
    """A Responses call's counter, with what the API holds: stored items, reasoning content."""

    def __init__(self, model: ModelPrices, registry: Registry, api: ResponsesApi) -> None:
        super().__init__(model, registry)
        self.api = api
        self._referring = 0

    def referring(self) -> _Referring:
        """Everything counted inside is input the body only refers to."""
        return _Referring(self)


class _Referring:
    def __init__(self, counter: ResponsesCounter) -> None:
        self.counter = counter

    def __enter__(self) -> None:
        prompt = self.counter.prompt
        self.start = (prompt.tokens, prompt.referenced_tokens)

    def __exit__(self, *exc_info: object) -> None:
        prompt = self.counter.prompt
        # Referred to whole: what was counted inside, once, whatever it referred to itself.
        prompt.referenced_tokens = self.start[1] + prompt.tokens - self.start[0]


def responses_prompt(body: dict[str, Any], counter: ResponsesCounter) -> Prompt:
    """The input of a call, after what `counter` already holds (a previous response, a
    conversation's items)."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or any(not _served_tool(t) for t in tools):
        raise InputError("the stub serves function, custom and namespace tools, local_shell and "
                         "tool_search, and the hosted web_search and web_search_preview",
                         "tools")
    counter.json_segment(tools)
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        counter.json_segment(text["format"].get("schema"))
    instructions = body.get("instructions")
    if instructions is not None:
        counter.segment({"instructions": instructions}, text_of(instructions, "instructions"))
    _stored_prompt(counter, body.get("prompt"))
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if items is None and body.get("prompt") is not None:
        items = []  # a stored prompt may be the whole input
    if not isinstance(items, list) or (not items and body.get("prompt") is None):
        raise InputError("input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        _item(counter, item, f"input[{i}]")
    return counter.prompt


def _served_tool(tool: object) -> bool:
    if not isinstance(tool, dict):
        return False
    kind = tool.get("type")
    if kind == "namespace":
        inner = tool.get("tools")
        return (isinstance(tool.get("name"), str) and isinstance(inner, list)
                and all(isinstance(t, dict) and t.get("type") in CLIENT_TOOL_TYPES
                        for t in inner))
    return kind in CLIENT_RUN_TOOL_TYPES | WEB_SEARCH_TYPES | WEB_SEARCH_PREVIEW_TYPES


def _stored_prompt(counter: ResponsesCounter, prompt: object) -> None:
    """A stored prompt: the tokens /control registered for its id, and its variables (strings
    as text, objects as input parts), as OpenAI substitutes them."""
    if prompt is None:
        return
    if not isinstance(prompt, dict) or not isinstance(prompt.get("id"), str):
        raise InputError("prompt must be an object with an id", "prompt")
    tokens = counter.registry.prompts.get(prompt["id"])
    if tokens is None:
        raise InputError(f"prompt {prompt['id']!r} not found", "prompt")
    variables = prompt.get("variables") or {}
    if not isinstance(variables, dict):
        raise InputError("prompt.variables must be an object", "prompt.variables")
    media = [0, 0, 0]
    text_bytes = 0
    for key, value in variables.items():
        where = f"prompt.variables[{key!r}]"
        text_bytes += (text_of(value, where) if isinstance(value, str)
                       else _part(counter, value, where, media))
    counter.media_segment(prompt, text_bytes, media, counter.refer(tokens))


def _item(counter: ResponsesCounter, item: object, where: str) -> None:
    counter.count_part(where)
    if not isinstance(item, dict):
        raise InputError("an input item must be an object", where)
    kind = item.get("type", "message")
    media = [0, 0, 0]
    referred = 0  # tokens of what the item only refers to that are not a file or image
    text_bytes = 0
    if kind == "message":
        content = item.get("content")
        if isinstance(content, str):
            text_bytes = len(content.encode())
        elif isinstance(content, list):
            for j, part in enumerate(content):
                text_bytes += _part(counter, part, f"{where}.content[{j}]", media)
        else:
            raise InputError("content must be a string or a list of parts", where)
    elif kind == "function_call":
        text_bytes = function_text(item, where)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        if isinstance(output, list):
            for j, part in enumerate(output):
                text_bytes += _part(counter, part, f"{where}.output[{j}]", media)
        else:
            text_bytes = text_of(output, where)
    elif kind == "custom_tool_call":
        text_bytes = text_of(item.get("name", ""), where) + text_of(item.get("input", ""), where)
    elif kind in CLIENT_CALL_ITEM_TYPES:
        text_bytes = len(json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode())
    elif kind == "web_search_call":
        action = item.get("action")
        query = action.get("query") if isinstance(action, dict) else None
        text_bytes = text_of(query, where) if isinstance(query, str) else 0
    elif kind == "reasoning":
        summary = item.get("summary") or []
        if not isinstance(summary, list):
            raise InputError("a reasoning item's summary must be a list", where)
        content = item.get("content") or []
        if not isinstance(content, list):
            raise InputError("a reasoning item's content must be a list", where)
        text_bytes = sum(text_of(s.get("text") if isinstance(s, dict) else s, where)
                         for s in (*summary, *content))
        # The reasoning itself, billed as input: by its encrypted content, else by its id.
        if item.get("encrypted_content") is not None:
            referred = counter.refer(counter.api.reasoning_tokens(item["encrypted_content"],
                                                                  where))
        elif item.get("id") is not None:
            referred = counter.refer(counter.api.stored_item(item["id"], where))
    elif kind == "item_reference":
        item_id = item.get("id")
        ref = counter.registry.files.get(str(item_id))
        if ref is not None:
            media[2] += counter.refer(counter.file_tokens(ref, where))
        else:
            referred = counter.refer(counter.api.stored_item(item_id, where))
    else:
        raise InputError(f"input item type {kind!r} is not served", where)
    counter.media_segment(item, text_bytes, media, referred)


def _part(counter: Counter, part: object, where: str, media: list[int]) -> int:
    counter.count_part(where)
    if not isinstance(part, dict):
        raise InputError("a content part must be an object", where)
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return text_of(part.get("text"), where)
    if kind == "refusal":
        return text_of(part.get("refusal"), where)
    if kind == "input_image":
        media[0] += counter.image(where, part.get("image_url"), part.get("file_id"),
                                  part.get("detail"))
    elif kind == "input_file":
        media[2] += counter.file(where, part.get("file_id"), part.get("file_data"),
                                 part.get("file_url"))
    else:
        raise InputError(f"content part type {kind!r} is not served", where)
    return 0


def registry_prompts(doc: object) -> dict[str, int]:
    """/control's `prompts`, OpenAI's stored prompts by id: {id: {"tokens": N}} (ValueError)."""
    if not isinstance(doc, dict) or len(doc) > REGISTRY_ENTRIES_MAX:
        raise ValueError(f"prompts is an object of at most {REGISTRY_ENTRIES_MAX} prompts")
    prompts = {}
    for key, entry in doc.items():
        if not isinstance(entry, dict) or set(entry) != {"tokens"}:
            raise ValueError(f"prompts[{key!r}] is {{tokens}}")
        prompts[str(key)] = count(entry["tokens"], f"prompts[{key!r}].tokens", 0)
    return prompts


def _conversation_items(doc: object) -> list[dict[str, Any]]:
    """Items given to a conversation, each with an id; their tokens are counted when a call
    reads them, at that call's model."""
    if (not isinstance(doc, list) or len(doc) > CONVERSATION_ITEMS_A_CALL_MAX
            or not all(isinstance(i, dict) for i in doc)):
        raise ApiError(400, f"items must be a list of at most {CONVERSATION_ITEMS_A_CALL_MAX} "
                       "objects", param="items")
    return [{"id": "msg_" + secrets.token_hex(24), **item} for item in doc]


def _bounded(kept: OrderedDict[str, Any], most: int) -> None:
    while len(kept) > most:
        kept.popitem(last=False)


def _seal(key: bytes, sealed: bytes) -> bytes:
    return hmac.new(key, sealed, hashlib.sha256).digest()[:16]


def _encrypted(key: bytes, item_id: str, tokens: int) -> str:
    """Reasoning content as the stub issues it: its tokens and item id, sealed with the key."""
    sealed = f"{tokens}:{item_id}".encode()
    return ENCRYPTED_PREFIX + base64.urlsafe_b64encode(sealed + _seal(key, sealed)).decode()


def _item_tokens(answer: Answer, item: dict[str, Any]) -> int:
    """An output item's tokens when it is input again: its text and a message's framing."""
    choice = answer.choices[0]
    if item["type"] == "reasoning":
        return choice.reasoning_tokens
    if item["type"] == "web_search_call":
        return TOKENS_PER_MESSAGE + text_tokens(len(item["action"]["query"].encode()))
    if item["type"] == "function_call":
        return TOKENS_PER_MESSAGE + text_tokens(len((item["name"] + item["arguments"]).encode()))
    return TOKENS_PER_MESSAGE + text_tokens(len(choice.text.encode()))


# -- the wire ------------------------------------------------------------------------------------


def _usage(answer: Answer) -> dict[str, Any]:
    u = answer.usage
    input_details: dict[str, int] = {"cached_tokens": u.cached_input_tokens}
    if answer.reports_cache_writes:
        input_details["cache_write_tokens"] = u.cache_write_tokens
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": input_details,
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.input_tokens + u.output_tokens,
    }


def _items(answer: Answer, key: bytes) -> list[dict[str, Any]]:
    """The output items of the answer: reasoning first, then the web searches, then a message
    or a call."""
    choice = answer.choices[0]
    suffix = answer.answer_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if choice.reasoning_tokens:
        rs_id = "rs_" + suffix
        reasoning = answer.request.get("reasoning")
        asked = isinstance(reasoning, dict) and reasoning.get("summary") not in (None, "none")
        summary = ([{"type": "summary_text",
                     "text": " ".join(words(min(choice.reasoning_tokens, SUMMARY_WORDS_MAX)))}]
                   if asked else [])
        items.append({"type": "reasoning", "id": rs_id, "summary": summary,
                      "encrypted_content": _encrypted(key, rs_id, choice.reasoning_tokens)})
    include = answer.request.get("include") or ()
    for n in range(answer.web_searches):
        action: dict[str, Any] = {"type": "search", "query": f"stub search {n + 1}"}
        if "web_search_call.action.sources" in include:
            action["sources"] = [{"type": "url", "url": f"https://stub.example/{n + 1}"}]
        items.append({"type": "web_search_call", "id": f"ws_{suffix}{n:03d}",
                      "status": "completed", "action": action})
    if choice.tool_call is not None:
        call_id, name, arguments = choice.tool_call
        call = {"type": "function_call", "id": "fc_" + suffix, "call_id": call_id,
                "name": name, "arguments": arguments, "status": "completed"}
        if choice.tool_namespace is not None:
            call["namespace"] = choice.tool_namespace
        items.append(call)
    else:
        items.append({"type": "message", "id": "msg_" + suffix, "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": choice.text,
                                   "annotations": [], "logprobs": []}]})
    return items
