"""Faults and settings of the stub provider (X-Stub-* headers and POST /control), and the contract
each of its APIs serves a call under.

Parsing and checking: a body or header that does not parse is refused whole (400), since a
half-read fault would make a test pass for the wrong reason. How a fault changes a call is the
same on every API (infra.stub_provider runs it; its docstring lists the faults): each API module
(infra.stub_chat, infra.stub_responses, infra.stub_messages) implements `Api`, deciding a call
before its first byte and giving its answer as a body or as stream events, and the app does the
rest: the faults, the bill, the two ways a fault ends a call (a body broken off and a hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from infra.stub_bill import Usage
from infra.stub_prices import TIER_STANDARD
from infra.stub_tokens import FileRef

# The registries are bounded: a careless test must not grow the stub without end.
REGISTRY_ENTRIES_MAX = 10_000
# A hung call is held this long at most, so a forgotten client cannot keep the stub busy forever.
HANG_S_MAX = 600.0
# Whose request fields the OpenAI routes bill (the setting `upstream_fields`): OpenAI's alone,
# or OpenRouter's too (its web plugin and fallback models), the first by default.
UPSTREAM_OPENAI = "openai"
UPSTREAM_OPENROUTER = "openrouter"
UPSTREAM_FIELDS = (UPSTREAM_OPENAI, UPSTREAM_OPENROUTER)
# Input an Anthropic web search's results add: the stub's own default, since Anthropic documents
# no size. Below the minimum the results cannot be laid out to their size (their url and title
# alone exceed it).
WEB_SEARCH_RESULT_TOKENS_DEFAULT = 8_000
WEB_SEARCH_RESULT_TOKENS_MIN = 64
# Tokens per streamed text delta: enough deltas to exercise a client's stream parser, few
# enough to be cheap.
CHUNK_TOKENS = 16
# The "model" answers with these words, one token each.
WORDS = ("the", "ceiling", "holds", "when", "every", "call", "reserves", "first", "and", "settles")


@dataclass
class Fault:
    """What the next calls do besides (or instead of) answering; `calls_left` None: until
    cleared. At most one of the first five; the last three combine with any of them."""

    fail_status: int | None = None
    hang: bool = False
    fail_after_billing: int | None = None
    hang_after_billing: bool = False
    break_after_events: int | None = None
    continuous_usage: bool = False
    cached_tokens: int | None = None
    web_searches: int | None = None
    calls_left: int | None = None

    @property
    def name(self) -> str | None:
        """The fault that changes the answer, as logged in the bill."""
        for f in fields(self)[:-1]:
            value = getattr(self, f.name)
            # `is`, not `in (None, False)`: 0 == False, and break_after_events=0 is a fault.
            if value is not None and value is not False:
                return f.name
        return None

    @property
    def active(self) -> bool:
        return self.name is not None and self.calls_left != 0

    def to_json(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "calls_left"}
        return {**doc, "calls": self.calls_left}


# Each fault's header: X-Stub- and its name in dashes (X-Stub-Fail-Status: fail_status).
FAULT_HEADERS = {"x-stub-" + f.name.replace("_", "-"): f.name for f in fields(Fault)[:-1]}
SETTINGS = frozenset({"images", "files", "prompt_cache", "default_service_tier", "upstream_fields",
                      "answer_padding_bytes", "clock_offset_s", "web_search_result_tokens",
                      "tool_calls"})
# The scripted tool calls /control may queue: enough for any agent test, few enough to list whole.
TOOL_CALLS_MAX = 100


def _status(raw: object, what: str) -> int:
    status = int(raw) if isinstance(raw, str) and raw.isdigit() else raw
    if type(status) is not int or not 400 <= status <= 599:
        raise ValueError(f"{what} must be an HTTP error status, 400 to 599")
    return status


def count(raw: object, what: str, minimum: int) -> int:
    value = int(raw) if isinstance(raw, str) and raw.isdigit() else raw
    if type(value) is not int or value < minimum:
        raise ValueError(f"{what} must be an integer of at least {minimum}")
    return value


def _flag(raw: object, what: str) -> bool:
    if raw in ("1", "true", True):
        return True
    if raw in ("0", "false", False):
        return False
    raise ValueError(f"{what} must be a boolean")


def fault_from(doc: Mapping[str, object]) -> Fault:
    """A Fault from /control's JSON or from X-Stub-* header values (strings)."""

    def given(name: str, parse: Any, *args: object) -> Any:
        return None if doc.get(name) is None else parse(doc[name], name, *args)

    fault = Fault(
        fail_status=given("fail_status", _status),
        hang=_flag(doc.get("hang", False), "hang"),
        fail_after_billing=given("fail_after_billing", _status),
        hang_after_billing=_flag(doc.get("hang_after_billing", False), "hang_after_billing"),
        break_after_events=given("break_after_events", count, 0),
        continuous_usage=_flag(doc.get("continuous_usage", False), "continuous_usage"),
        cached_tokens=given("cached_tokens", count, 0),
        web_searches=given("web_searches", count, 0),
        calls_left=given("calls", count, 1),
    )
    exclusive = [fault.fail_status is not None, fault.hang, fault.fail_after_billing is not None,
                 fault.hang_after_billing, fault.break_after_events is not None]
    if sum(exclusive) > 1:
        raise ValueError("give one of fail_status, hang, fail_after_billing, "
                         "hang_after_billing and break_after_events")
    return fault


@dataclass(frozen=True)
class Settings:
    """What /control sets besides faults and the registry; each stays until set again."""

    prompt_cache: bool = True
    default_service_tier: str = TIER_STANDARD  # what `auto` is served at
    upstream_fields: str = UPSTREAM_OPENAI
    answer_padding_bytes: int = 0
    web_search_result_tokens: int = WEB_SEARCH_RESULT_TOKENS_DEFAULT
    clock_offset_s: float = 0.0  # added to the clock the prompt caches expire by
    # Scripted tool calls, a queue of {"name", "input": object}: the next call whose tools
    # include a queued call's name answers with the first such call and takes it off the queue.
    tool_calls: tuple[dict[str, Any], ...] = ()

    def updated(self, doc: Mapping[str, Any]) -> Settings:
        """These settings with those `doc` gives, each checked (ValueError)."""
        prompt_cache = doc.get("prompt_cache", self.prompt_cache)
        tier = doc.get("default_service_tier", self.default_service_tier)
        if type(prompt_cache) is not bool or not isinstance(tier, str):
            raise ValueError("prompt_cache is a boolean, default_service_tier a string")
        upstream = doc.get("upstream_fields", self.upstream_fields)
        if upstream not in UPSTREAM_FIELDS:
            raise ValueError(f"upstream_fields is one of {', '.join(UPSTREAM_FIELDS)}")
        search_tokens = count(doc.get("web_search_result_tokens", self.web_search_result_tokens),
                              "web_search_result_tokens", WEB_SEARCH_RESULT_TOKENS_MIN)
        padding = count(doc.get("answer_padding_bytes", self.answer_padding_bytes),
                        "answer_padding_bytes", 0)
        offset_s = doc.get("clock_offset_s", self.clock_offset_s)
        if type(offset_s) not in (int, float) or not 0 <= offset_s < math.inf:
            raise ValueError("clock_offset_s is a number of seconds, 0 or more")
        tool_calls = (self.tool_calls if "tool_calls" not in doc
                      else scripted_tool_calls(doc["tool_calls"]))
        return Settings(prompt_cache, tier, str(upstream), padding, search_tokens,
                        float(offset_s), tool_calls)


def scripted_tool_calls(doc: object) -> tuple[dict[str, Any], ...]:
    """/control's `tool_calls`: each {"name", "input": object} (Anthropic's shape) or {"name",
    "arguments": object or its JSON text} (OpenAI's), kept as {"name", "input"}."""
    if not isinstance(doc, list) or len(doc) > TOOL_CALLS_MAX:
        raise ValueError(f"tool_calls is a list of at most {TOOL_CALLS_MAX} calls")
    calls = []
    for i, call in enumerate(doc):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call[
                "name"] or len(set(call) & {"input", "arguments"}) != 1 or set(call) - {
                "name", "input", "arguments"}:
            raise ValueError(f'tool_calls[{i}] is {{"name", "input"}} or {{"name", "arguments"}}')
        given = call.get("input", call.get("arguments"))
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except ValueError as exc:
                raise ValueError(f"tool_calls[{i}].arguments is not JSON") from exc
        if not isinstance(given, dict):
            raise ValueError(f"tool_calls[{i}]: the input is a JSON object")
        calls.append({"name": call["name"], "input": given})
    return tuple(calls)


def registry_images(doc: object) -> dict[str, tuple[int, int]]:
    if not isinstance(doc, dict) or len(doc) > REGISTRY_ENTRIES_MAX:
        raise ValueError(f"images is an object of at most {REGISTRY_ENTRIES_MAX} URLs")
    return {str(url): _size(size, f"images[{url!r}]") for url, size in doc.items()}


def _size(raw: object, what: str) -> tuple[int, int]:
    if (not isinstance(raw, list) or len(raw) != 2
            or any(type(v) is not int or v < 1 for v in raw)):
        raise ValueError(f"{what} must be [width, height] in pixels")
    return raw[0], raw[1]


def registry_files(doc: object) -> dict[str, FileRef]:
    if not isinstance(doc, dict) or len(doc) > REGISTRY_ENTRIES_MAX:
        raise ValueError(f"files is an object of at most {REGISTRY_ENTRIES_MAX} entries")
    files = {}
    for key, entry in doc.items():
        if not isinstance(entry, dict) or set(entry) - {"bytes", "pages", "image"}:
            raise ValueError(f"files[{key!r}] is {{bytes, pages, image}}")
        image = entry.get("image")
        files[str(key)] = FileRef(
            count(entry.get("bytes"), f"files[{key!r}].bytes", 0),
            count(entry.get("pages", 0), f"files[{key!r}].pages", 0),
            None if image is None else _size(image, f"files[{key!r}].image"),
        )
    return files


# -- the contract an API serves a call under ---------------------------------------------------


class ApiError(Exception):
    """An answer in the API's error shape, nothing billed unless the call already was. `code`,
    `error_type` and `param` are OpenAI's fields; Anthropic's shape has a type by status."""

    def __init__(self, status: int, message: str, code: str = "invalid_request",
                 error_type: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.error_type = status, message, code, error_type
        self.param = param


def stub_failure(status: int, when: str) -> ApiError:
    return ApiError(status, f"stub failure {status} {when}", "stub_failure", "server_error")


@dataclass(frozen=True, kw_only=True)
class Decided:
    """A call decided before its first byte, not yet billed: what the bill logs of it."""

    model: str  # the model it is billed and answered as
    usage: Usage
    cost_micros: int
    service_tier: str
    model_requested: str | None = None  # the body's model, when it is billed as another
    # What the call billed (or cleared) beyond what its body holds, by name, for /billing's log:
    # tokens of server-side context (search results, compaction), cleared context, and the like.
    beyond_body: dict[str, int] | None = None


D = TypeVar("D", bound=Decided)


class Api(Generic[D]):
    """One API's part of a call, which the app runs (StubProviderApp.serve): `check` authorizes
    it and reads its betas; `decide` decides the whole answer or refuses it (ApiError, nothing
    billed); `charged` keeps what billing leaves behind (prompt caches, stored responses), which
    `reset` forgets; the answer is an `error`, a `body` or stream `events`, and `failed_events`
    a stream failed after billing, where the API reports that in the stream."""

    name: str  # as the bill logs it
    request_bytes_max: int | None = None
    # What a stream is sent as: SSE, but for an API with a framing of its own (Bedrock's).
    stream_media_type = "text/event-stream"

    def headers(self) -> dict[str, str]:
        return {}

    def check(self, request: Request) -> set[str]:
        raise NotImplementedError

    def model_of(self, body: dict[str, Any], request: Request) -> str | None:
        """The model the call names, as the bill logs it if refused: the body's by default (an
        API that names it in the path reads it there)."""
        model = body.get("model")
        return model if isinstance(model, str) else None

    def streams(self, body: dict[str, Any], request: Request) -> bool:
        """Whether the call is answered as a stream: the body's `stream` by default (an API
        that streams by route reads the route)."""
        return body.get("stream") is True

    def decide(self, body: dict[str, Any], request: Request, fault: Fault,
               betas: set[str]) -> D:
        raise NotImplementedError

    def charged(self, decided: D, fault: Fault) -> None:
        pass

    def reset(self) -> None:
        pass

    def error(self, error: ApiError, headers: dict[str, str]) -> Response:
        raise NotImplementedError

    def answer_headers(self, decided: D) -> dict[str, str]:
        """Headers of a decided call's answer beyond `headers` (Bedrock's token counts)."""
        return {}

    def body(self, decided: D) -> dict[str, Any]:
        raise NotImplementedError

    def events(self, decided: D, fault: Fault) -> list[bytes]:
        raise NotImplementedError

    def failed_events(self, decided: D, failure: ApiError) -> list[bytes] | None:
        return None


async def read_body(request: Request, bytes_max: int | None = None) -> dict[str, Any]:
    """The request's JSON object; above `bytes_max` bytes, 413."""
    too_large = ApiError(413, f"Request exceeds the maximum size of {bytes_max} bytes")
    length = request.headers.get("content-length", "")
    if bytes_max is not None and length.isdigit() and int(length) > bytes_max:
        raise too_large
    try:
        raw = await request.body()
    except ClientDisconnect as exc:  # gone before it finished sending: nothing to serve
        raise ApiError(499, "the client went away", "client_disconnected") from exc
    if bytes_max is not None and len(raw) > bytes_max:
        raise too_large
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, "the body is not JSON") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def header_count(request: Request, header: str, minimum: int) -> int | None:
    """A per-call X-Stub-* count (X-Stub-Output-Tokens and the like), named as given."""
    raw = request.headers.get(header)
    if raw is None:
        return None
    try:
        return count(raw, header, minimum)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


def words(tokens: int) -> tuple[str, ...]:
    """The visible answer of `tokens` tokens."""
    return tuple(WORDS[i % len(WORDS)] for i in range(tokens))


def sse(doc: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def pieces(text_words: tuple[str, ...]) -> list[str]:
    """The text of the words in deltas of CHUNK_TOKENS words, which joined give it back."""
    return [("" if start == 0 else " ") + " ".join(text_words[start:start + CHUNK_TOKENS])
            for start in range(0, len(text_words), CHUNK_TOKENS)]


# -- how a fault ends a call -------------------------------------------------------------------


class StreamBroken(Exception):
    """Raised inside a response body on purpose: uvicorn then drops the connection mid-body."""


class _QuietBreaks(logging.Filter):
    """Keep uvicorn from logging a deliberate break as an application error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StreamBroken))


logging.getLogger("uvicorn.error").addFilter(_QuietBreaks())


async def sent(events: list[bytes], *, broken: bool) -> AsyncIterator[bytes]:
    """A response body of `events`; `broken`: the connection is dropped after the last one."""
    for event in events:
        yield event
    if broken:
        raise StreamBroken("the stub broke this answer off on purpose")


async def hang(request: Request) -> None:
    """Answer nothing until the client goes away (or HANG_S_MAX passes)."""
    # Reading ASGI messages drains the body, then blocks until the client disconnects.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(HANG_S_MAX):
            while (await request.receive())["type"] != "http.disconnect":
                pass
