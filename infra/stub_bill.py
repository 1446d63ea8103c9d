"""The stub provider's bill: what it charged for every call it served, and a log of every request.

Shared by the stub (which writes it) and the harnesses that read it (`fetch_bill`). It imports
nothing from `core`: the bill is the witness the service is judged by, so it keeps its own books.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# The per-call log keeps the most recent calls only: a load run makes tens of thousands, and
# GET /billing returns the log whole. The tallies cover every call whatever the log dropped.
CALL_LOG_MAX = 10_000
MICROS_PER_USD = 1_000_000


@dataclass(frozen=True)
class Usage:
    """What one call consumed, as the stub counted it. Every part is a subset of a total:
    `input_tokens` holds the cached, cache-write, audio, image and file tokens (and, for
    Anthropic, the web search results fed back to the model); `cache_write_tokens` holds the
    1-hour writes; `output_tokens` holds the reasoning (thinking), audio and rejected-prediction
    tokens (all billed as output). `web_search_requests` counts searches, billed per search;
    `web_search_calls` counts calls billed a search model's per-call fee (0 or 1 a call);
    `web_plugin_results` counts the web results of OpenRouter's web plugin, billed per result.
    OpenAI's hosted web search tool on Responses: `web_search_tool_calls` counts its searches
    billed at the table's per-call fee, `web_search_preview_calls` those billed at the dearer
    fee of `web_search_preview` on a model that does not reason; `web_search_content_tokens`
    (part of `input_tokens`) is the search content fed to the model. `referenced_input_tokens`
    (part of `input_tokens`) is input the body only refers to: a previous response, stored items,
    reasoning sent back, a conversation, a stored prompt, files and images by id or URL."""

    input_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0
    audio_input_tokens: int = 0
    image_input_tokens: int = 0
    file_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    audio_output_tokens: int = 0
    rejected_prediction_tokens: int = 0
    web_search_requests: int = 0
    web_search_calls: int = 0
    web_plugin_results: int = 0
    web_search_tool_calls: int = 0
    web_search_preview_calls: int = 0
    web_search_content_tokens: int = 0
    referenced_input_tokens: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{f.name} must be a non-negative integer")
        input_parts = (self.cached_input_tokens + self.cache_write_tokens
                       + self.audio_input_tokens)
        output_parts = (self.audio_output_tokens + self.reasoning_tokens
                        + self.rejected_prediction_tokens)
        if (input_parts > self.input_tokens or output_parts > self.output_tokens
                or self.referenced_input_tokens + self.web_search_content_tokens
                > self.input_tokens
                or self.cache_write_1h_tokens > self.cache_write_tokens):
            raise ValueError("a part of the usage is larger than its total")

    @property
    def text_input_tokens(self) -> int:
        """Input billed at the plain input rate (text, image and file tokens)."""
        return (self.input_tokens - self.cached_input_tokens - self.cache_write_tokens
                - self.audio_input_tokens)

    @property
    def text_output_tokens(self) -> int:
        return self.output_tokens - self.audio_output_tokens


@dataclass(frozen=True)
class Tally(Usage):
    """Calls billed and what they cost, in one bill or one model's part of it: the sum of their
    usage, how many they were and their cost."""

    calls: int = 0
    cost_micros: int = 0

    def plus(self, usage: Usage, cost_micros: int) -> Tally:
        summed = {f.name: getattr(self, f.name) + getattr(usage, f.name) for f in fields(Usage)}
        return Tally(**summed, calls=self.calls + 1, cost_micros=self.cost_micros + cost_micros)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Tally:
        return cls(**{f.name: int(doc.get(f.name, 0)) for f in fields(cls)})


@dataclass(frozen=True)
class CallRecord:
    """One request as the stub saw it: billed or not, and the status it answered."""

    api: str  # "chat.completions", "responses" or "messages"
    model: str | None  # None when the request was refused before its model was read
    status: int
    billed: bool
    cost_micros: int
    usage: Usage | None
    stream: bool = False
    service_tier: str | None = None
    fault: str | None = None  # the fault the call was made to show, if any
    # The body's model when the call was billed (and answered) as another: `model` is the one
    # billed (OpenRouter's fallback `models`).
    model_requested: str | None = None
    # Tokens billed (or cleared) beyond the body, by name (Decided.beyond_body).
    beyond_body: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CallRecord:
        usage = doc.get("usage")
        return cls(
            api=str(doc["api"]), model=doc.get("model"), status=int(doc["status"]),
            billed=bool(doc["billed"]), cost_micros=int(doc["cost_micros"]),
            usage=None if usage is None else Usage(**usage), stream=bool(doc.get("stream")),
            service_tier=doc.get("service_tier"), fault=doc.get("fault"),
            model_requested=doc.get("model_requested"), beyond_body=doc.get("beyond_body"),
        )


@dataclass
class Bill:
    """What the provider charges: billed calls, every request that arrived at all, and a log."""

    requests: int = 0
    total: Tally = field(default_factory=Tally)
    by_model: dict[str, Tally] = field(default_factory=dict)
    log: deque[CallRecord] = field(default_factory=lambda: deque(maxlen=CALL_LOG_MAX))

    def record(self, call: CallRecord) -> None:
        """Log a request; a billed one is added to the tallies too."""
        self.log.append(call)
        if call.billed and call.usage is not None and call.model is not None:
            self.total = self.total.plus(call.usage, call.cost_micros)
            self.by_model[call.model] = self.by_model.get(call.model, Tally()).plus(
                call.usage, call.cost_micros)

    def to_json(self, *, with_log: bool = True) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "requests": self.requests,
            **asdict(self.total),
            "cost_usd": usd(self.total.cost_micros),
            "by_model": {m: asdict(t) for m, t in sorted(self.by_model.items())},
        }
        if with_log:
            doc["log"] = [c.to_json() for c in self.log]
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Bill:
        log: deque[CallRecord] = deque(
            (CallRecord.from_json(c) for c in doc.get("log", ())), maxlen=CALL_LOG_MAX)
        return cls(
            int(doc["requests"]), Tally.from_json(doc),
            {m: Tally.from_json(t) for m, t in doc["by_model"].items()}, log,
        )


def usd(micros: int) -> str:
    """Micro-dollars as a dollar string with six decimals, by integer arithmetic."""
    whole, part = divmod(micros, MICROS_PER_USD)
    return f"{whole}.{part:06d}"
