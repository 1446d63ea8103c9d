"""What OpenAI's two APIs on the stub provider share: how a call is counted, decided and billed.

Chat Completions (infra.stub_chat) and Responses (infra.stub_responses) differ in their fields
and wire formats; the rules here are the same for both:

- Input: infra.stub_tokens' rules, for the content parts both APIs take (images by data: URL,
  http(s) URL or file id; audio; files). Output is at most the cap (4,096 when none is sent),
  drawn at random by the app; a reasoning model spends a share of each answer reasoning, by the
  effort asked (billed as output). Each of `n` choices is its own draw.
- Service tiers: `auto` (or none) is served at the /control setting `default_service_tier`
  where the model has it; a tier the model lacks is refused.
- Prompt cache (https://developers.openai.com/api/docs/guides/prompt-caching): prefixes of at
  least 1,024 tokens, hits reported in 128-token steps. Every prefix of a billed call that
  ends at a message boundary is cached; a later call on the same model that starts with one
  reads it at the cached-input rate. A model with a cache-write rate is billed that rate for
  the cached tokens a call wrote, and reports them.
- Search models: a model with `web_search_usd_per_call` searches before every answer and is
  billed that fee once a call on top of its tokens; the search content is not billed.
- The context window (`context_window_tokens` in the table): a call whose whole input (the
  body and everything it refers to) is above it is refused, 400 `context_length_exceeded`,
  unbilled; with `truncation: "auto"` the oldest input is dropped until it fits, what the body
  only refers to first, so a call is never billed more input than the window. The hosted web
  search's content (Responses) is held to what the window leaves.
- Input the body only refers to (files and images by id or URL here; Responses has more) is
  billed as input and reported in the bill as `referenced_input_tokens`.
- Structured outputs (chat `response_format`, Responses `text.format`: json_schema or
  json_object): the answer is the schema's least document (schema_instance), billed as its
  text, cut off at the cap, so a client's parser gets a document it accepts.
- OpenAI's long context (a model's `long_context`, no beta): a call whose input is above the
  threshold is billed whole at those rates (rates_tier).
- Scripted tool calls (/control `tool_calls`): the first queued call whose tool a call offers
  (a function tool, or a function in a `namespace` tool) is that call's answer, its arguments
  billed as output text, and leaves the queue; a call offering none of them answers as usual.
- OpenRouter's fields (`upstream_fields: openrouter`; ignored otherwise): `plugins: [{"id":
  "web", "max_results": N, "engine": "exa"}]` fetches N results (the table's default when
  absent), billed at the table's per-result rate; another plugin or engine is refused.
  `models: [...]` are fallbacks billed at the model that served the call: the stub bills the
  dearest the table prices for the whole call and answers under its name
  (https://openrouter.ai/docs/features/web-search, .../guides/routing/model-fallbacks).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infra.stub_bill import Usage
from infra.stub_faults import (
    CHUNK_TOKENS,
    UPSTREAM_OPENROUTER,
    Api,
    ApiError,
    Decided,
    Fault,
    header_count,
    words,
)
from infra.stub_prices import (
    TIER_LONG_CONTEXT,
    TIER_STANDARD,
    ModelPrices,
    cost_micros,
    unpriced,
)
from infra.stub_tokens import (
    BYTES_PER_TOKEN,
    TOKENS_PER_MESSAGE,
    TOKENS_PER_REPLY,
    FileRef,
    InputError,
    Registry,
    Walk,
    audio_seconds,
    data_url_bytes,
    decode_base64,
    image_size,
    image_tokens,
    pdf_pages,
    read_at,
    text_tokens,
)

if TYPE_CHECKING:
    from infra.stub_provider import StubProviderApp

# OpenAI answers up to the model's output limit when no cap is sent; the stub stops here.
OUTPUT_TOKENS_UNCAPPED_MAX = 4_096
# OpenAI's limit on choices a chat call may ask for.
CHOICES_MAX = 128
CACHE_TOKENS_MIN = 1_024
CACHE_TOKENS_STEP = 128
# The cache is bounded: a long load run must not grow the stub without end. Oldest out first.
CACHE_PREFIXES_MAX = 10_000
# The share of an answer a reasoning model spends reasoning, by requested effort (the stub's own
# choice: providers document no share, only that reasoning tokens count as output).
REASONING_SHARE = {"none": Fraction(0), "minimal": Fraction(0), "low": Fraction(1, 4),
                   "medium": Fraction(1, 2), "high": Fraction(3, 4), "xhigh": Fraction(7, 8),
                   "max": Fraction(15, 16), "ultra": Fraction(15, 16)}
REASONING_EFFORT_DEFAULT = "medium"
# OpenRouter's web plugin engines the stub prices: Exa's results, at the table's rate. "native"
# search is billed at the model provider's own search price, which the table does not hold.
WEB_PLUGIN_ENGINES = ("exa",)
DETAILS = ("low", "high", "auto")
AUDIO_FORMATS = ("wav", "mp3")


# -- counting ------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """A request's input, counted. `prefixes` are the prompt cache's view of it: the digest of
    each prefix that ends at a message boundary, with the tokens up to there."""

    tokens: int = TOKENS_PER_REPLY
    image_tokens: int = 0
    audio_tokens: int = 0
    file_tokens: int = 0
    prefixes: list[tuple[bytes, int]] = field(default_factory=list)
    referenced_tokens: int = 0  # of `tokens`: what the body only refers to
    search_content_tokens: int = 0  # of `tokens`: the hosted web search's content


class Counter(Walk):
    """Counts one request's segments (tools, instructions, messages or items) in order."""

    def __init__(self, model: ModelPrices, registry: Registry) -> None:
        super().__init__(model, registry)
        self.prompt = Prompt()
        self._cacheable = True

    def refer(self, tokens: int) -> int:
        """`tokens` the body only refers to (sized from what the stub holds), counted as such."""
        self.prompt.referenced_tokens += tokens
        return tokens

    def segment(self, source: object, text_bytes: int, media_tokens: int = 0, *,
                framed: bool = True, audio: bool = False) -> None:
        """Add one segment: its text, its media tokens, and a message's framing if `framed`."""
        self.prompt.tokens += (text_tokens(text_bytes) + media_tokens
                               + (TOKENS_PER_MESSAGE if framed else 0))
        # The cache holds exact prefixes; audio is not cached, and nothing after it is either.
        if audio:
            self._cacheable = False
        if self._cacheable:
            self.chain(source)
            self.prompt.prefixes.append((self.digest, self.prompt.tokens))

    def json_segment(self, source: object) -> None:
        """Tool definitions or a schema: billed by their JSON bytes, with no message framing."""
        if source:
            size = len(json.dumps(source, separators=(",", ":"), ensure_ascii=False).encode())
            self.segment(source, size, framed=False)

    def media_segment(self, source: object, text_bytes: int, media: list[int],
                      other_tokens: int = 0) -> None:
        """A message or item: its text, its [image, audio, file] tokens, and `other_tokens`
        that are none of those (reasoning sent back, a stored item or prompt)."""
        image, audio, files = media
        self.prompt.image_tokens += image
        self.prompt.audio_tokens += audio
        self.prompt.file_tokens += files
        self.segment(source, text_bytes, image + audio + files + other_tokens, audio=audio > 0)

    def image(self, where: str, url: object, file_id: object, detail: object) -> int:
        rule = self.model.image
        if rule is None:
            raise InputError(f"{self.model.name} does not accept image input", where)
        detail = "auto" if detail is None else detail
        if detail not in DETAILS:
            raise InputError(f"detail must be one of {', '.join(DETAILS)}", where)
        if isinstance(file_id, str) and url is None:
            ref = self.registry.files.get(file_id)
            if ref is None or ref.image is None:
                raise InputError(f"no image file with id {file_id!r}", where)
            size = ref.image
            return self.refer(image_tokens(rule, size[0], size[1], str(detail)))
        elif isinstance(url, str) and url.startswith("data:"):
            with read_at(where):
                mime, data = data_url_bytes(url, "the image")
                size = image_size(data)[1]
            if not mime.startswith("image/"):
                raise InputError(f"an image data: URL must be image/*, not {mime!r}", where)
        elif isinstance(url, str) and url.startswith(("http://", "https://")):
            known = self.registry.images.get(url)
            if known is None:
                raise InputError(f"the image at {url} could not be downloaded", where)
            return self.refer(image_tokens(rule, known[0], known[1], str(detail)))
        else:
            raise InputError("an image needs a data: or http(s) URL or a file id", where)
        return image_tokens(rule, size[0], size[1], str(detail))

    def audio(self, where: str, audio: object) -> int:
        if self.model.standard.audio_input is None:
            raise InputError(f"{self.model.name} does not accept audio input", where)
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
            raise InputError("input_audio needs data (base64) and format", where)
        audio_format = audio.get("format")
        if audio_format not in AUDIO_FORMATS:
            raise InputError(f"input_audio.format must be one of {', '.join(AUDIO_FORMATS)}",
                             where)
        with read_at(where):
            seconds = audio_seconds(decode_base64(audio["data"], "input_audio.data"),
                                    str(audio_format))
        return math.ceil(seconds * self.model.audio_input_tokens_per_s)

    def file(self, where: str, file_id: object, file_data: object, file_url: object) -> int:
        given = [v for v in (file_id, file_data, file_url) if v is not None]
        if len(given) != 1 or not isinstance(given[0], str):
            raise InputError("a file needs one of file_id, file_data or file_url", where)
        if isinstance(file_data, str):
            with read_at(where):
                data = (data_url_bytes(file_data, "file_data")[1] if file_data.startswith("data:")
                        else decode_base64(file_data, "file_data"))
            ref = FileRef(len(data), pdf_pages(data))
        else:
            known = self.registry.files.get(given[0])
            if known is None:
                raise InputError(f"no file {given[0]!r}", where)
            return self.refer(self.file_tokens(known, where))
        return self.file_tokens(ref, where)


def text_of(value: object, where: str) -> int:
    """The UTF-8 bytes of a string field."""
    if not isinstance(value, str):
        raise InputError("expected a string", where)
    return len(value.encode())


def function_text(call: object, where: str) -> int:
    """A tool call the model made earlier, fed back as input: its name and arguments."""
    if not isinstance(call, dict):
        raise InputError("a tool call must be an object", where)
    function = call.get("function", call)
    if not isinstance(function, dict):
        raise InputError("a tool call needs a function", where)
    return sum(text_of(function.get(k, ""), where) for k in ("name", "arguments"))


# -- the call ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """One generated answer: visible words plus hidden reasoning, within the output cap."""

    index: int
    words: tuple[str, ...]
    reasoning_tokens: int
    finish_reason: str  # "stop", "length" or "tool_calls"
    tool_call: tuple[str, str, str] | None = None  # (call id, function name, arguments)
    tool_namespace: str | None = None  # the namespace tool that holds the function called
    # What joins the words: a space between words of prose; nothing between the pieces of a
    # JSON answer, each of which is one token of its text.
    joiner: str = " "

    @property
    def text(self) -> str:
        return self.joiner.join(self.words)

    def deltas(self) -> list[tuple[str, int]]:
        """The text as a stream sends it, in deltas of CHUNK_TOKENS tokens, each with its
        tokens: joined, they give the text back."""
        return [(("" if start == 0 else self.joiner)
                 + self.joiner.join(self.words[start:start + CHUNK_TOKENS]),
                 len(self.words[start:start + CHUNK_TOKENS]))
                for start in range(0, len(self.words), CHUNK_TOKENS)]

    @property
    def output_tokens(self) -> int:
        return len(self.words) + self.reasoning_tokens


@dataclass(frozen=True, kw_only=True)
class Answer(Decided):
    """An OpenAI call decided: its choices, and what its wire format says besides."""

    answer_id: str
    choices: tuple[Choice, ...]
    reports_cache_writes: bool  # the model has a cache-write rate, so usage names the writes
    audio_output: bool = False
    created_s: int = field(default_factory=lambda: int(time.time()))
    request: dict[str, Any]  # the body, which Responses echoes
    prompt: Prompt
    prices: ModelPrices  # the requested model's, whose prompt cache the call uses
    web_searches: int = 0  # hosted web searches run before the answer
    truncated_tokens: int = 0  # input dropped to fit the context window (`truncation: auto`)


def checked_bearer(key: str | None, request: Request) -> set[str]:
    """OpenAI's authentication: the key as a bearer token (any, when the stub has none)."""
    if key is not None and request.headers.get("authorization") != f"Bearer {key}":
        raise ApiError(401, "incorrect API key", "invalid_api_key")
    return set()


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> Response:
    """An error in OpenAI's shape."""
    body = {"error": {"message": error.message, "type": error.error_type,
                      "param": error.param, "code": error.code}}
    return JSONResponse(body, status_code=error.status, headers=headers)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _cache_step(tokens: int) -> int:
    """Cached tokens as OpenAI reports them: 0 below 1,024, else down to a 128-token step."""
    if tokens < CACHE_TOKENS_MIN:
        return 0
    return CACHE_TOKENS_MIN + (tokens - CACHE_TOKENS_MIN) // CACHE_TOKENS_STEP * CACHE_TOKENS_STEP


def _function_name(spec: object) -> str | None:
    """The function a tool or tool choice names: `name` (Responses) or `function.name` (chat)."""
    if not isinstance(spec, dict):
        return None
    function = spec.get("function")
    name = spec.get("name") or (function.get("name") if isinstance(function, dict) else None)
    return name if isinstance(name, str) else None


def forced_tool(body: dict[str, Any]) -> str | None:
    """The function a call must answer with: `tool_choice` "required" or a named function."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return _function_name(choice)
    if choice == "required":
        return next(iter(callable_functions(body)), None)
    return None


def callable_functions(body: dict[str, Any]) -> dict[str, str | None]:
    """The functions a call's tools offer, each with the namespace tool holding it (None: a
    function tool of its own; chat's and Responses' shapes both)."""
    tools = body.get("tools")
    found: dict[str, str | None] = {}
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            inner = tool.get("tools")
            for member in inner if isinstance(inner, list) else ():
                name = _function_name(member)
                if name is not None and isinstance(tool.get("name"), str):
                    found.setdefault(name, tool["name"])
        elif isinstance(tool, dict) and tool.get("type") in ("function", "custom"):
            name = _function_name(tool)
            if name is not None:
                found.setdefault(name, None)
    return found


# A schema nested deeper than this is answered with null there: no real one nests so deep, and
# a recursive one ($ref to itself) must end. Nor does a document take more values than the
# second bound, however its arrays multiply (a structured answer is the stub's work, unbilled).
SCHEMA_DEPTH_MAX = 16
SCHEMA_VALUES_MAX = 10_000
# Strings a structured answer gives, by their JSON schema `format`.
FORMAT_EXAMPLES = {"date-time": "2026-01-01T00:00:00Z", "date": "2026-01-01", "time": "00:00:00",
                   "email": "stub@example.com", "uri": "https://stub.example/",
                   "uuid": "00000000-0000-4000-8000-000000000000"}


def schema_instance(schema: object, root: object = None, depth: int = 0,
                    budget: list[int] | None = None) -> Any:
    """The least document a JSON schema (as structured outputs take them) accepts: every
    property of an object (strict mode requires them all), the fewest items an array takes,
    the first of an enum or a union, the smallest number and a short string."""
    root = schema if root is None else root
    budget = [SCHEMA_VALUES_MAX] if budget is None else budget
    budget[0] -= 1
    if not isinstance(schema, dict) or depth > SCHEMA_DEPTH_MAX or budget[0] < 0:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for key in ref[2:].split("/"):
            target = target.get(key) if isinstance(target, dict) else None
        return schema_instance(target, root, depth + 1, budget)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for union in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(union), list) and schema[union]:
            return schema_instance(schema[union][0], root, depth + 1, budget)
    kind = schema.get("type", "object" if "properties" in schema else None)
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        properties = schema.get("properties")
        return {name: schema_instance(sub, root, depth + 1, budget)
                for name, sub in (properties.items() if isinstance(properties, dict) else ())}
    if kind == "array":
        least = schema.get("minItems", 0)
        least = least if type(least) is int and 0 <= least <= SCHEMA_DEPTH_MAX else 0
        return [schema_instance(schema.get("items"), root, depth + 1, budget)
                for _ in range(least)]
    if kind == "string":
        least = schema.get("minLength", 0)
        text = FORMAT_EXAMPLES.get(str(schema.get("format")), "the ceiling holds")
        return text + "x" * max(0, least - len(text)) if type(least) is int else text
    if kind in ("integer", "number"):
        bound = schema.get("minimum", schema.get("exclusiveMinimum"))
        if not isinstance(bound, int | float) or isinstance(bound, bool):
            return 0
        if "minimum" in schema:
            return math.ceil(bound) if kind == "integer" else bound
        return math.floor(bound) + 1
    if kind == "boolean":
        return False
    return None


def json_tokens(document: Any) -> tuple[str, ...]:
    """A JSON document's text in pieces of one token each (ASCII, so 4 bytes a token)."""
    text = json.dumps(document, separators=(",", ":"))
    return tuple(text[at:at + BYTES_PER_TOKEN] for at in range(0, len(text), BYTES_PER_TOKEN))


def function_parameters(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The JSON schema of the parameters of the function `name` a call's tools declare (in a
    namespace tool or not; chat's and Responses' shapes), if it declares properties."""
    tools = body.get("tools")
    specs: list[object] = []
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            inner = tool.get("tools")
            specs.extend(inner if isinstance(inner, list) else ())
        else:
            specs.append(tool)
    for spec in specs:
        if _function_name(spec) == name and isinstance(spec, dict):
            function = spec.get("function")
            holder = function if isinstance(function, dict) else spec
            parameters = holder.get("parameters")
            if isinstance(parameters, dict) and isinstance(parameters.get("properties"), dict):
                return parameters
    return None


def rates_tier(prices: ModelPrices, tier: str, usage: Usage) -> str:
    """The rates a call is billed at: its tier's, or at standard a long-context model's long
    context rates when its input is above the threshold (OpenAI's: the whole call, no beta,
    https://developers.openai.com/api/docs/pricing). The call still answers its own tier."""
    long = prices.long_context
    if (long is not None and long.beta is None and tier == TIER_STANDARD
            and usage.input_tokens > long.above_input_tokens):
        return TIER_LONG_CONTEXT
    return tier


def _fallback_models(doc: object) -> tuple[str, ...]:
    """OpenRouter's `models`: the models a call may fall back to, in order."""
    if doc is None:
        return ()
    if not isinstance(doc, list) or not all(isinstance(m, str) for m in doc):
        raise invalid("models must be a list of model names", "models")
    return tuple(doc)


class OpenAIApi(Api[Answer]):
    """The rules both OpenAI routes share; each route's own fields are its subclass's hooks."""

    id_prefix: str
    cap_fields: tuple[str, ...]

    def __init__(self, app: StubProviderApp,
                 cache: OrderedDict[tuple[str, bytes], None]) -> None:
        self.app = app
        self.cache = cache  # shared by both routes: (model, prefix digest) -> None
        self.reset()

    def reset(self) -> None:
        self.cache.clear()

    # -- the route's own fields (each subclass's) ------------------------------------------------

    def prompt(self, body: dict[str, Any], prices: ModelPrices) -> Prompt:
        raise NotImplementedError

    def choices_asked(self, body: dict[str, Any]) -> object:
        return 1

    def effort(self, body: dict[str, Any]) -> object:
        raise NotImplementedError

    def audio_output(self, body: dict[str, Any], prices: ModelPrices) -> bool:
        return False

    def output_schema(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The JSON schema a call's answer must follow ({} for any JSON object), or None."""
        return None

    def rejected_prediction(self, body: dict[str, Any], choices: int) -> int:
        return 0

    # -- the call --------------------------------------------------------------------------------

    def check(self, request: Request) -> set[str]:
        return checked_bearer(self.app.api_key, request)

    def error(self, error: ApiError, headers: dict[str, str]) -> Response:
        return error_response(error)

    def decide(self, body: dict[str, Any], request: Request, fault: Fault,
               betas: set[str]) -> Answer:
        name = body.get("model")
        if not isinstance(name, str):
            raise invalid("model is required", "model")
        prices = self.app.prices.model(name)
        # An unpriced model cannot be billed, so it is not served; nor is Anthropic's model here,
        # nor an embedding model.
        if prices is None or prices.messages is not None or prices.embedding is not None:
            raise ApiError(404, f"the model {name!r} does not exist", "model_not_found",
                           param="model")
        tier = self._tier(body, prices)
        openrouter = self.app.settings.upstream_fields == UPSTREAM_OPENROUTER
        plugin_results = self._web_plugin_results(body.get("plugins")) if openrouter else 0
        fallbacks = _fallback_models(body.get("models")) if openrouter else ()
        try:
            prompt = self.prompt(body, prices)
            searches, preview = self.web_searches(body, prices, fault)
        except InputError as exc:
            raise invalid(str(exc), exc.param) from exc
        truncated = self._fit(body, prices, prompt)
        self._search_content(prices, prompt, searches)
        audio_output = self.audio_output(body, prices)
        # Last of the checks: a scripted tool call is taken off its queue only by a call served.
        choices = self._choices(body, prices, request)
        rejected = self.rejected_prediction(body, len(choices))
        cached, written = self._cached(prices, prompt, fault)
        usage = Usage(
            input_tokens=prompt.tokens, cached_input_tokens=cached, cache_write_tokens=written,
            audio_input_tokens=prompt.audio_tokens, image_input_tokens=prompt.image_tokens,
            file_input_tokens=prompt.file_tokens,
            output_tokens=sum(c.output_tokens for c in choices) + rejected,
            reasoning_tokens=sum(c.reasoning_tokens for c in choices),
            audio_output_tokens=sum(len(c.words) for c in choices) if audio_output else 0,
            rejected_prediction_tokens=rejected,
            # A search model searches before every answer: one fee a call, on top of tokens.
            web_search_calls=int(prices.web_search_call_micros is not None),
            web_plugin_results=plugin_results,
            web_search_tool_calls=searches, web_search_preview_calls=preview,
            web_search_content_tokens=prompt.search_content_tokens,
            referenced_input_tokens=prompt.referenced_tokens,
        )
        billed_name, tier, usage, cost = self._dearest(name, prices, tier, usage, fallbacks)
        return Answer(
            model=billed_name, usage=usage, cost_micros=cost, service_tier=tier,
            model_requested=None if billed_name == name else name,
            answer_id=self.id_prefix + secrets.token_hex(12), choices=tuple(choices),
            reports_cache_writes=prices.standard.cache_write is not None,
            audio_output=audio_output, request=body, prompt=prompt, prices=prices,
            web_searches=searches + preview, truncated_tokens=truncated,
        )

    def charged(self, decided: Answer, fault: Fault) -> None:
        if self.app.settings.prompt_cache and fault.cached_tokens is None:
            for digest, tokens in decided.prompt.prefixes:
                if tokens >= CACHE_TOKENS_MIN:
                    self.cache[(decided.prices.name, digest)] = None
                    self.cache.move_to_end((decided.prices.name, digest))
            while len(self.cache) > CACHE_PREFIXES_MAX:
                self.cache.popitem(last=False)

    def web_searches(self, body: dict[str, Any], prices: ModelPrices,
                     fault: Fault) -> tuple[int, int]:
        """(searches at the web search fee, searches at the preview fee) a call's hosted tools
        run: none but on Responses."""
        return 0, 0

    def _fit(self, body: dict[str, Any], prices: ModelPrices, prompt: Prompt) -> int:
        """Hold the input to the model's context window: above it, refused as OpenAI refuses
        it, unless `truncation: "auto"`, which drops the oldest input (what the body only
        refers to first) until it fits. The tokens dropped."""
        window = prices.context_window_tokens
        if window is None or prompt.tokens <= window:
            return 0
        if body.get("truncation") != "auto":
            raise ApiError(400, f"Your input exceeds the context window of this model "
                           f"({prompt.tokens} tokens, {window} at most). Please adjust your "
                           "input and try again.", "context_length_exceeded", param="input")
        dropped = prompt.tokens - window
        prompt.tokens = window
        prompt.referenced_tokens = max(0, prompt.referenced_tokens - dropped)
        # What was dropped is the oldest input: the prefixes the cache holds are gone with it,
        # and what is left may be media or text alike, so the media counts are held to it too.
        prompt.prefixes = []
        prompt.image_tokens = min(prompt.image_tokens, window)
        prompt.file_tokens = min(prompt.file_tokens, window)
        prompt.audio_tokens = min(prompt.audio_tokens, window)
        return dropped

    def _search_content(self, prices: ModelPrices, prompt: Prompt, searches: int) -> None:
        """The content of `searches` hosted web searches, fed to the model as input: a fixed
        block a search where the model bills one, else the /control setting
        `web_search_result_tokens` a search; within the context window what the input left."""
        if not searches:
            return
        per_search = prices.web_search_content_tokens or self.app.settings.web_search_result_tokens
        content = searches * per_search
        if prices.context_window_tokens is not None:
            content = min(content, max(0, prices.context_window_tokens - prompt.tokens))
        prompt.tokens += content
        prompt.search_content_tokens += content

    def _tier(self, body: dict[str, Any], prices: ModelPrices) -> str:
        asked = body.get("service_tier")
        if asked in (None, "auto"):
            tier = self.app.settings.default_service_tier
            # `auto` is served at the project's default tier where the model has it.
            return tier if tier == TIER_STANDARD or tier in prices.tiers else TIER_STANDARD
        if asked == TIER_STANDARD or (isinstance(asked, str) and asked in prices.tiers):
            return str(asked)
        raise invalid(f"service_tier {asked!r} is not available for {prices.name}",
                      "service_tier")

    def output_cap(self, body: dict[str, Any], prices: ModelPrices) -> int:
        caps = [body[f] for f in self.cap_fields if body.get(f) is not None]
        if not caps:
            return OUTPUT_TOKENS_UNCAPPED_MAX
        cap = caps[0]
        if type(cap) is not int or cap < 1:
            raise invalid(f"{self.cap_fields[0]} must be a positive integer", self.cap_fields[0])
        return cap

    def _reasoning_share(self, body: dict[str, Any], model: ModelPrices) -> Fraction:
        effort = self.effort(body)
        if effort is None:
            return REASONING_SHARE[REASONING_EFFORT_DEFAULT] if model.reasoning else Fraction(0)
        if not model.reasoning:
            raise invalid(f"reasoning effort is not supported with {model.name}",
                          "reasoning_effort")
        if effort not in REASONING_SHARE:
            raise invalid(f"reasoning effort must be one of {', '.join(REASONING_SHARE)}",
                          "reasoning_effort")
        return REASONING_SHARE[str(effort)]

    def _choices(self, body: dict[str, Any], prices: ModelPrices,
                 request: Request) -> list[Choice]:
        count = self.choices_asked(body)
        if type(count) is not int or not 1 <= count <= CHOICES_MAX:
            raise invalid(f"n must be an integer from 1 to {CHOICES_MAX}", "n")
        cap = self.output_cap(body, prices)
        share = self._reasoning_share(body, prices)
        forced = header_count(request, "X-Stub-Output-Tokens", 1)
        forced_reasoning = header_count(request, "X-Stub-Reasoning-Tokens", 0)
        if forced_reasoning and not prices.reasoning:
            raise invalid(f"{prices.name} is not a reasoning model")
        tool = forced_tool(body)
        schema = self.output_schema(body) if tool is None else None
        script = self._scripted(body) if count == 1 else None
        choices = []
        if script is not None:
            total = forced or self.app.draw_output_tokens()
            reasoning = min(cap, forced_reasoning if forced_reasoning is not None
                            else math.floor(total * share))
            name, arguments, namespace = script
            # The call's arguments are its visible output, whatever the cap.
            visible = words(text_tokens(len(arguments.encode())))
            return [Choice(0, visible, reasoning, "tool_calls",
                           ("call_" + secrets.token_hex(8), name, arguments), namespace)]
        for index in range(count):
            total = min(cap, forced or self.app.draw_output_tokens())
            reasoning = (min(total, forced_reasoning) if forced_reasoning is not None
                         else math.floor(total * share))
            visible = words(total - reasoning)
            finish = "length" if total == cap else "stop"
            if schema is not None:
                # A structured answer is the schema's least document, cut off at the cap.
                document = json_tokens(schema_instance(schema))
                visible = document[:cap - reasoning]
                finish = "length" if len(visible) < len(document) else "stop"
                choices.append(Choice(index, visible, reasoning, finish, joiner=""))
                continue
            tool_call = None
            if tool is not None:
                # Arguments a client's own check accepts: the least document of the function's
                # parameters where it declares them, billed as the answer drawn (its words).
                parameters = function_parameters(body, tool)
                given: Any = (schema_instance(parameters) if parameters is not None
                              else {"text": " ".join(visible)})
                tool_call = ("call_" + secrets.token_hex(8), tool, json.dumps(given))
                finish = "length" if total == cap else "tool_calls"
            choices.append(Choice(index, visible, reasoning, finish, tool_call,
                                  callable_functions(body).get(tool) if tool else None))
        return choices

    def _scripted(self, body: dict[str, Any]) -> tuple[str, str, str | None] | None:
        """The first call /control queued (`tool_calls`, infra.stub_faults) whose tool this call
        offers, taken off the queue: its name, its arguments' JSON text and the namespace
        holding it. None with `tool_choice: "none"`."""
        if body.get("tool_choice") == "none":
            return None
        offered = callable_functions(body)
        queue = list(self.app.settings.tool_calls)
        for call in queue:
            if call["name"] in offered:
                queue.remove(call)
                self.app.settings = replace(self.app.settings, tool_calls=tuple(queue))
                return call["name"], json.dumps(call["input"]), offered[call["name"]]
        return None

    def _cached(self, prices: ModelPrices, prompt: Prompt, fault: Fault) -> tuple[int, int]:
        """(cached tokens read, tokens written) for this prompt."""
        cacheable = prompt.tokens - prompt.audio_tokens
        if fault.cached_tokens is not None:
            return min(fault.cached_tokens, cacheable), 0
        if not self.app.settings.prompt_cache:
            return 0, 0
        matched = next((tokens for digest, tokens in reversed(prompt.prefixes)
                        if (prices.name, digest) in self.cache), 0)
        cached = _cache_step(matched)
        written = 0
        if prices.standard.cache_write is not None and prompt.prefixes:
            written = max(0, _cache_step(prompt.prefixes[-1][1]) - cached)
        return cached, written

    def _web_plugin_results(self, plugins: object) -> int:
        """The web results OpenRouter's `plugins` fetch: a `web` plugin's `max_results`, else the
        table's default. A plugin the stub cannot price is refused, not served free."""
        if plugins is None:
            return 0
        if not isinstance(plugins, list) or not all(
                isinstance(p, dict) and isinstance(p.get("id"), str) for p in plugins):
            raise invalid("plugins must be a list of objects with an id", "plugins")
        ids = [p["id"] for p in plugins]
        if set(ids) - {"web"} or len(ids) != len(set(ids)):
            raise invalid("the stub serves the web plugin only, once", "plugins")
        if not plugins:
            return 0
        [web] = plugins
        rates = self.app.prices.openrouter
        if rates is None:
            raise invalid("the stub's table prices no web plugin", "plugins")
        if web.get("engine") not in (None, *WEB_PLUGIN_ENGINES):
            raise invalid(f"the web plugin's engine is one of {', '.join(WEB_PLUGIN_ENGINES)}",
                          "plugins")
        results = web.get("max_results", rates.web_results_default)
        if type(results) is not int or results < 1:
            raise invalid("the web plugin's max_results must be a positive integer", "plugins")
        return results

    def _dearest(self, name: str, prices: ModelPrices, tier: str, usage: Usage,
                 fallbacks: tuple[str, ...]) -> tuple[str, str, Usage, int]:
        """The model a call is billed at, with its tier, usage and cost: the requested one, or
        the dearest of OpenRouter's fallback `models` that the table prices for the whole call
        (a fallback may serve any call, so the witness bills the worst). Ties keep the
        earlier."""
        openrouter = self.app.prices.openrouter
        tools = self.app.prices.openai_tools
        best = (name, tier, usage, cost_micros(prices, rates_tier(prices, tier, usage), usage,
                                               openrouter=openrouter, openai_tools=tools))
        for other_name in fallbacks:
            other = self.app.prices.model(other_name)
            if other is None:
                continue
            other_tier = tier if tier == TIER_STANDARD or tier in other.tiers else TIER_STANDARD
            # A search model searches on whichever call it serves; another model never does.
            other_usage = replace(
                usage, web_search_calls=int(other.web_search_call_micros is not None))
            billed_tier = rates_tier(other, other_tier, other_usage)
            if unpriced(other, billed_tier, other_usage, openrouter=openrouter,
                        openai_tools=tools) is not None:
                continue
            micros = cost_micros(other, billed_tier, other_usage, openrouter=openrouter,
                                 openai_tools=tools)
            if micros > best[3]:
                best = (other_name, other_tier, other_usage, micros)
        return best
