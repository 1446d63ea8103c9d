"""What a wire format is, and the parts every format's reading of a call is made of.

A wire format is one provider API as the gateway reads it (core/formats/chat.py, responses.py,
messages.py). It holds everything that differs between APIs: its paths, the provider its calls go
to and how that provider takes its key, its output-cap fields, the top-level fields it forwards
(its allow-list) and the ones it refuses with a reason, the client headers it forwards, how it
prices a request (plan, with its own walker of the prompt's messages or items over the shared
core/content.py Walk), its request body's schema for the OpenAPI document, how it reads the
usage an answer reports, where its stream ends, and the shape of its errors (a refusal's body and
a stream's error event). What every format shares is here: the priced request (Plan), the stream's
event splitter (StreamTally), the allow-list check, the output cap, and the usage reading that
takes, wherever providers differ, the reading that costs more. core/gateway.py decides the money
from these and never asks which format a call is in.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from core.budgets import user_of_value
from core.config import Config
from core.content import NO_MEDIA, InputBound, Media, json_bytes
from core.errors import CeilingError, FieldUnsupported, InvalidRequest, InvariantBroken
from core.formats.names import Api as Api  # a format's name (core/formats/names.py)
from core.formats.schema import Schema as Schema  # the type of the schemas a format carries
from core.jsonbody import loads_answer
from core.ledger import Upstream
from core.prices import TIER_AUTO, Usage
from core.service import CallSpec
from core.upstream_kinds.kind import bill_at
from core.upstreams import UpstreamDef

# One encoder for every forwarded body: json.dumps with options builds a new one per call.
_BODY_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)

# Bounds the gateway set on a call that gave none: (field, value), in the order set.
Bounds = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Provider:
    """Where a format's calls go: the base URL and the key the operator set for a provider, and
    the header the provider takes its key in. Formats of one provider share it, and with it one
    pooled client (api/upstream.py)."""

    upstream: Upstream  # whose bill its calls are on (core/reconcile.py)
    url_setting: str  # the setting that names its base URL, which keys its client
    url_example: str  # what url_setting is set to for the provider itself
    url: Callable[[Config], str | None]
    api_key: Callable[[Config], str | None]
    # The header that carries the key, and what comes before the key in it.
    auth_header: tuple[str, str]
    # Its answers' headers the client gets besides the common ones (api/upstream.py
    # RELAYED_HEADERS): its request ids, rate limits and the like, by prefix.
    relayed_header_prefixes: tuple[str, ...] = ()
    # The host of the provider's own API: its calls are on `upstream`'s bill only there
    # (core/upstream_kinds/kind.py bill_at); None: wherever url_setting points.
    bill_host: str | None = None

    def auth(self, key: str) -> tuple[str, str]:
        return self.auth_header[0], self.auth_header[1] + key

    def bill(self, config: Config) -> Upstream:
        """Whose bill its calls are on where `config` sends them: the one the operator names
        for it (Config.shorthand_bills), else its own at its own host only."""
        return config.shorthand_bills.get(self.url_setting) or bill_at(
            self.upstream, self.bill_host, self.url(config))

    @property
    def unset(self) -> str:
        """Why a call cannot be forwarded while url_setting is not set."""
        return (f"{self.url_setting} is not set: the gateway has no {self.upstream} provider to "
                f"forward to; set it to the provider's base URL, such as {self.url_example}")


class WireFormat(ABC):
    """One provider API: what the gateway needs to know of it, each difference in one place.

    Subclassed once per API, and made once (core/formats FORMATS). The attributes are data; the
    methods are the API's reading of a request, an answer and a stream, and its errors' shape."""

    api: Api  # its name, and its path below its provider's base URL
    # The route CEILING_UPSTREAMS routes its calls on: the name the kinds of upstream list in
    # their routes (core/upstream_kinds UpstreamKind.routes). Two formats of one API (a call
    # and its stream) share one.
    routed_as: str
    route: str  # the gateway's path for it
    name: str  # its route's endpoint: the OpenAPI document's operation and summary
    provider: Provider
    # Its request body as the OpenAPI document shows it (core/formats/schema.py): what the
    # gateway reads to bound a call, for the people who write its clients.
    body_schema: Schema
    # The output cap's field names, the one the gateway sets (when the caller sets none) last.
    cap_fields: tuple[str, ...]
    # The top-level fields forwarded, each because its billing effect is known; any other is
    # refused by name (FieldUnsupported) and nothing is forwarded, but for the two below.
    allowed_fields: frozenset[str]
    # Fields that make a call cost what its body cannot bound: refused (InvalidRequest).
    unbounded_fields: tuple[str, ...] = ()
    # Fields that feed the model input the request does not contain: refused (InputUnbounded).
    unbounded_input_fields: tuple[str, ...] = ()
    # The client's request headers forwarded to the provider with the body.
    forwarded_headers: tuple[str, ...] = ()
    # Its token counting endpoint, if the API has one the provider bills nothing for: the path
    # below the provider's base URL, and the gateway's route for it (api/routes/gateway.py).
    count_path: str | None = None
    count_route: str | None = None
    # Its token counting route's endpoint name (the OpenAPI operation): `<name>_count_tokens`
    # unless it says otherwise.
    count_name: str | None = None
    # For a format whose model is in its path: the API versions its clients call, the first
    # the one its paths (`route`, `count_route`) are written with; each is served alike.
    path_versions: tuple[str, ...] = ()
    # The header its clients send their key in when they send no Authorization, if any; and
    # the query parameter they may send it in instead (Google's `?key=`).
    key_header: str | None = None
    key_query: str | None = None
    # Whether its model is named in its path rather than its body (Gemini's
    # `models/{model}:generateContent`): the route reads it from its path (the `{model}` of
    # `route`, `api` and `count_path`) and passes it to plan; a body then names none.
    model_in_path: bool = False
    # What the route accepts in each header of its own (key_header, forwarded_headers).
    header_schemas: Mapping[str, Schema] = MappingProxyType({})
    # A usage's (input, output, input details, output details) fields.
    usage_fields: tuple[str, str, str, str]
    # A stream event's data that ends the stream, not forwarded; and what the relay sends after
    # the bill's trailer of a complete stream (the same marker, for chat completions).
    done_data: str | None = None
    stream_end: bytes = b""
    # Whether a stream's bill follows its last event as SSE comment lines (core/gateway.py
    # Relay): not where the format's SDK parses every line of the stream as an event.
    stream_trailer: bool = True

    def __init__(self) -> None:
        # Every field this format knows, allowed or refused with its own reason.
        self.known_fields = (self.allowed_fields | frozenset(self.unbounded_fields)
                             | frozenset(self.unbounded_input_fields))

    @property
    def headers(self) -> tuple[str, ...]:
        """The request headers its route reads beyond the gateway's own."""
        return (*((self.key_header,) if self.key_header else ()), *self.forwarded_headers)

    def check_fields(self, body: Mapping[str, Any], fields_allowed: frozenset[str]) -> None:
        """FieldUnsupported for the first top-level field it does not know (`fields_allowed`:
        the operator's, CEILING_GATEWAY_FIELDS_ALLOWED)."""
        known = self.known_fields
        for field in body:
            if field not in known and field not in fields_allowed:
                # Named as sent, but a lone surrogate (valid in a JSON escape, not in UTF-8) is
                # shown escaped: the answer must encode.
                field = field.encode("utf-8", "backslashreplace").decode()
                raise FieldUnsupported(
                    f"{field} is not a field the gateway forwards: what it bills is not known (it "
                    "may change the call's rates or feed the model input the request does not "
                    "contain), so nothing was forwarded or reserved", field=field)

    def count_checked(self, body: dict[str, Any], headers: tuple[tuple[str, str], ...],
                      betas_allowed: frozenset[str]) -> None:
        """Check a token counting request's headers as plan() would a call's (its fields are
        checked by check_fields): nothing is held for it, but what it forwards is named. A
        format that forwards no headers of its own has nothing more to check."""
        del body, headers, betas_allowed

    @abstractmethod
    def plan(self, body: dict[str, Any], model: str, headers: tuple[tuple[str, str], ...],
             output_tokens_default: int, betas_allowed: frozenset[str] = frozenset()) -> Plan:
        """Price a request whose fields and model were checked (core/gateway.py plan)."""

    # Where a request names its end user, in the order read: field paths in the body.
    user_fields: tuple[tuple[str, ...], ...] = ()

    def end_user(self, body: dict[str, Any]) -> str | None:
        """The end user the request names in its body, or None: the first of user_fields given.
        A value that is not an id names the user by its digest (core/budgets.py user_of_value):
        the providers take any string there, and clients send what they like."""
        for path in self.user_fields:
            value: Any = body
            for name in path:
                value = value.get(name) if isinstance(value, dict) else None
            if value is not None:
                return user_of_value(value)
        return None

    def cap_added(self, body: dict[str, Any], output_tokens_default: int) -> Bounds:
        """The output cap the gateway sets (output_cap) on a call that gives none."""
        if any(body.get(f) is not None for f in self.cap_fields):
            return ()
        return ((self.cap_fields[-1], output_tokens_default),)

    def answer_usage(self, doc: dict[str, Any]) -> Usage | None:
        """The usage a complete answer (a non-streamed body, or the final response a stream
        carries) reports."""
        return self.usage_of(doc.get("usage"), doc.get("service_tier"))

    def output_cap(self, body: dict[str, Any], output_tokens_default: int) -> int:
        """The call's output cap, as given; else `output_tokens_default`, set in the body."""
        fields = self.cap_fields
        caps = {positive_int(body[f], f) for f in fields if body.get(f) is not None}
        if len(caps) > 1:
            raise InvalidRequest(
                f"give one output cap ({' or '.join(fields)}), or equal values",
                field=fields[-1],
            )
        if not caps:
            body[fields[-1]] = output_tokens_default
            return output_tokens_default
        return caps.pop()

    def clamped_body(self, body: dict[str, Any], output_tokens_max: int) -> dict[str, Any]:
        """A copy of `body` sent with the lower output cap X-Ceiling-Clamp chose."""
        body = dict(body)
        for field in self.cap_fields:
            if body.get(field) is not None:
                body[field] = output_tokens_max
        return body

    def long_context_refusal(self, model: str) -> CeilingError:
        """Why a call opened to long-context rates cannot be held for `model`, whose rates have
        none (core/gateway.py hold); only a format whose plan sets long_context has one."""
        return InvariantBroken(f"{self.api} plans no long-context call")

    def usage_of(self, usage: object, service_tier: object = None) -> Usage | None:
        """The usage an answer reports, and the tier it names (read_usage)."""
        return read_usage(usage, self.usage_fields, service_tier)

    @abstractmethod
    def stream_event(self, tally: StreamTally, doc: dict[str, Any]) -> bool:
        """Note what one of its stream's events says in `tally` (its usage, its end); whether
        the client gets the event."""

    @abstractmethod
    def error_body(self, error: dict[str, Any]) -> dict[str, Any]:
        """An error as api/errors.py writes it ({"type", "code", "message", ...details}), in
        the shape its provider's clients parse."""

    @abstractmethod
    def error_event(self, error: dict[str, Any]) -> bytes:
        """The event a stream already answered 200 ends on with `error`: its clients raise it."""

    def error_status(self, shaped: dict[str, Any], status: int) -> int:
        """The HTTP status a refusal of body `shaped` (error_body's) is sent with: api/errors.py's
        `status`, unless the format's shape names its own."""
        del shaped
        return status


@dataclass(frozen=True)
class Plan:
    """One request, priced: the body to forward and the bounds of what it may cost."""

    wire: WireFormat
    model: str
    body: dict[str, Any]
    stream: bool
    text_tokens_max: int  # the input's text, framing included
    output_tokens_max: int  # per choice
    choices: int
    usage_wanted: bool  # a chat stream whose client asked for the usage chunk itself
    media: Media = NO_MEDIA  # the input's images and audio, priced by the model's rules
    service_tier: str = TIER_AUTO  # as asked for; a request that names none is `auto`
    headers: tuple[tuple[str, str], ...] = ()  # the client's headers forwarded with the body
    long_context: bool = False  # priced at long-context rates (a Messages beta opened them)
    bounds_added: Bounds = ()  # what the gateway set where the client gave no bound
    # The named upstream (CEILING_UPSTREAMS) the call goes to, whose prices table holds and
    # settles it; None: the format's provider (the one-upstream shorthands) and its table.
    routed_to: UpstreamDef | None = None
    # A routed call's model as its upstream prices it (Routed.priced_model), which budgets count
    # it by (CallSpec.model_name); None: `model`.
    priced_model: str | None = None
    # The name the upstream knows the model by (Routed.sent_model), where a format names it in
    # its path (Gemini's) and `model` is the name it is priced by; None: `model`.
    sent_model: str | None = None
    # Whose bill the call is on where it is sent, where that is not its provider's (`billed`).
    bill: Upstream | None = None

    @property
    def api(self) -> Api:
        return self.wire.api

    @property
    def billed(self) -> Upstream:
        """Whose bill the call is on (core/reconcile.py): a routed call's upstream's
        (core/upstreams.py bill_of), else its provider's where the gateway sends it."""
        return self.bill or self.wire.provider.upstream

    @property
    def model_sent(self) -> str:
        """The name the upstream is sent the model by: the routing's (sent_model), else the
        name it is priced by (a Bedrock id or a regional Vertex name differ from the latter)."""
        return self.sent_model or self.model

    def spec(self, output_tokens_max: int | None = None) -> CallSpec:
        return CallSpec(
            model=self.model, input_tokens=self.text_tokens_max,
            output_tokens_max=output_tokens_max or self.output_tokens_max, choices=self.choices,
            media=self.media, service_tier=self.service_tier, bill=self.billed,
            # As prices_provider says, inline: spec() prices every call, at least once.
            provider=self.wire.provider.upstream.value if self.routed_to is None else (
                self.routed_to.prices_provider),
            model_name=self.priced_model,
        )

    @property
    def prices_provider(self) -> str:
        """The genai-prices provider whose table prices the call."""
        routed_to = self.routed_to
        return self.wire.provider.upstream.value if routed_to is None else (
            routed_to.prices_provider)

    def clamped(self, output_tokens_max: int) -> Plan:
        return replace(self, body=self.wire.clamped_body(self.body, output_tokens_max),
                       output_tokens_max=output_tokens_max)

    def content(self) -> bytes:
        """The body as priced, encoded anew rather than forwarded as the client's bytes: a key
        given twice is resolved by each JSON parser its own way (first or last wins, or an
        error), and the provider must read the document the gateway priced."""
        return _BODY_ENCODER.encode(self.body).encode()


class StreamTally:
    """What a provider's stream has said so far, and which of its bytes the client gets.

    Fed the stream's bytes as they come, it splits them into server-sent events and hands each
    to its format (WireFormat.stream_event), which keeps the last usage reported (a provider
    may report cumulative usage in every chunk, vLLM's continuous usage stats: only the last
    covers the whole answer; a format may report it in parts, kept in `reported`) and notes the
    terminal event. It returns the events to forward: all of them but those its format holds
    back (the usage chunk the gateway asked for on the client's behalf, and the chat stream's
    `[DONE]`, which the relay sends after its trailer). A stream is complete only once its
    terminal event came: usage seen before it may be partial.
    """

    def __init__(self, call_plan: Plan) -> None:
        self.plan = call_plan
        self.usage: Usage | None = None
        self.finished = False
        self.reported: dict[str, Any] = {}  # the usage reported in parts so far
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        if b"\r" in self._buffer:
            self._buffer = self._buffer.replace(b"\r\n", b"\n")
        out = []
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n")
                    if line.startswith(b"data:")]
            if not data or self._take(b"\n".join(data).decode(errors="replace")):
                out.append(event + b"\n\n")
        return b"".join(out)

    def _take(self, data: str) -> bool:
        wire = self.plan.wire
        if data == wire.done_data:
            self.finished = True
            return False
        doc = loads_answer(data)
        if not isinstance(doc, dict):
            return True
        return wire.stream_event(self, doc)


def positive_int(value: object, field: str) -> int:
    if type(value) is not int or value < 1:
        raise InvalidRequest(f"{field} must be a positive integer", field=field)
    return value


def text_tokens(body: dict[str, Any], prompt_field: str, prompt: InputBound) -> int:
    """The prompt's bound, and everything else in the body as forwarded that the provider may
    tokenize (instructions, system prompts, tools, schemas) by its bytes: the framing fields
    counted with it only raise the bound, and two requests that forward the same body are
    priced the same."""
    return prompt.text_tokens + json_bytes({k: v for k, v in body.items() if k != prompt_field})


def count(value: object) -> int:
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise ValueError(f"not a token count: {value!r}")
    return value


def read_usage(usage: object, fields: tuple[str, str, str, str],
               service_tier: object = None) -> Usage | None:
    """The usage a provider reported under `fields` (input, output, input details, output
    details), and the service tier its answer names; None if it reported no usage we can read
    (the call is then settled from an upper bound).

    Read as OpenAI reports it: cache reads and audio are parts of the input tokens, reasoning
    and audio parts of the output tokens. Where a compatible provider reports otherwise, the
    reading that costs more is taken: reasoning tokens above the output count, or a total above
    input plus output, are output the count left out; cache reads and writes reported beside
    the input count, Anthropic's way (cache_read_input_tokens, cache_creation_input_tokens), are
    input on top of it. An answer that names no tier is priced at the dearest it could be. The
    web searches a provider ran are read from `server_tool_use` (Anthropic's)."""
    if not isinstance(usage, dict):
        return None
    input_field, output_field, input_details, output_details = fields
    try:
        given_in = usage.get(input_details) or {}
        given_out = usage.get(output_details) or {}
        if not isinstance(given_in, dict) or not isinstance(given_out, dict):
            return None
        input_tokens, output_tokens = count(usage[input_field]), count(usage[output_field])
        # Anthropic's cache counts sit beside the input count rather than in it; the 1-hour
        # writes are split out of all writes in `cache_creation`.
        creation = usage.get("cache_creation")
        creation = creation if isinstance(creation, dict) else {}
        writes_1h = count(creation.get("ephemeral_1h_input_tokens"))
        writes_beside = max(count(usage.get("cache_creation_input_tokens")),
                            writes_1h + count(creation.get("ephemeral_5m_input_tokens")))
        reads_beside = count(usage.get("cache_read_input_tokens"))
        input_tokens += writes_beside + reads_beside
        reads = count(given_in.get("cached_tokens")) + reads_beside
        writes = count(given_in.get("cache_write_tokens")) + writes_beside - writes_1h
        reasoning = count(given_out.get("reasoning_tokens"))
        if reasoning > output_tokens:
            output_tokens += reasoning
        total = usage.get("total_tokens")
        if type(total) is int and total - input_tokens > output_tokens:
            output_tokens = total - input_tokens
        server_tools = usage.get("server_tool_use")
        searches = count(server_tools.get("web_search_requests")) if isinstance(
            server_tools, dict) else 0
        return Usage(
            input_tokens, output_tokens, reads, writes, writes_1h,
            count(given_in.get("audio_tokens")), count(given_out.get("audio_tokens")),
            service_tier if isinstance(service_tier, str) and service_tier else TIER_AUTO,
            searches,
        )
    except (KeyError, ValueError, CeilingError):
        return None
