"""Google's Gemini API: POST /v1beta/models/{model}:generateContent and
:streamGenerateContent?alt=sse (and :countTokens, which Google bills nothing for), forwarded to
the Gemini upstream with the provider's key in x-goog-api-key.

Its model is named in its path, not its body (WireFormat.model_in_path): the route reads it
there and passes it to plan. Streaming is chosen by the path too, so the API is two formats of
one class, GEMINI and GEMINI_STREAM. A client sends its key in x-goog-api-key or as `?key=`
(key_header, key_query).

Besides what every format prices, a Gemini call is held at (https://ai.google.dev/gemini-api/
docs/tokens, /pricing, /thinking, /grounding):
- its thinking on top of maxOutputTokens, for Gemini 2.5 and 3 alike. What Google documents:
  thinking tokens are billed at the output rate ("response pricing is the sum of output tokens
  and thinking tokens", https://ai.google.dev/gemini-api/docs/thinking#pricing), a budget is
  guidance the model "might overflow or underflow" (ibid., and Vertex AI's
  https://cloud.google.com/vertex-ai/generative-ai/docs/thinking), and maxOutputTokens is "the
  maximum number of tokens to include in a response candidate"
  (https://ai.google.dev/api/generate-content#generationconfig). Neither the Gemini API's nor
  Vertex AI's documentation says thoughts count inside maxOutputTokens; users observe that they
  do (googleapis/python-genai #782, #2062, the last noting the documentation describes them as
  separate). Unknown means held: the cap and the budget are held side by side, which covers
  both readings (within the cap the sum is a double bound, never a short one); a budget
  overflowed beyond it is the one case neither reading bounds, settled above the hold and
  recorded as overshoot. The budget is the request's thinkingBudget (a positive one at least
  the least of the model's documented range, to which Google may raise one below it), or where
  it is dynamic (-1), absent on a model that thinks by default, or set by thinkingLevel, the
  model's documented maximum (GEMINI_THINKING);
- candidateCount answers;
- media by Google's rules: an image by its tiles (read from its header), audio at 32 tokens a
  second of the duration its bytes bound, text files by their bytes; a video, a PDF, other audio,
  and whatever the request only refers to (fileData, cachedContent, urlContext's fetched pages,
  codeExecution's results) at the model's context window; a thought signature sent back at the
  model's output limit;
- Google Search grounding: a fee per grounded prompt (Gemini 2.x) or per search query (later
  models, bounded by the prices file's web_searches_max, else refused), its results as input.
Google's token rules for media and thinking are in core/formats/gemini_tokens.py.
Its usage is `usageMetadata`; its errors are Google's `{"error": {"code", "message", "status"}}`.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

from core.content import (
    TOKENS_PER_MESSAGE,
    InputBound,
    Walk,
    audio_ms_max,
    encodable,
    json_bytes,
)
from core.errors import InputUnbounded, InvalidRequest
from core.formats.base import (
    Api,
    Bounds,
    Plan,
    Provider,
    StreamTally,
    WireFormat,
    count,
    positive_int,
)
from core.formats.gemini_tokens import (
    AUDIO_FORMATS,
    GEMINI_BEFORE_3,
    GEMINI_THINKING,
    IMAGE_TILE_MODELS,
    MEDIA_RESOLUTIONS,
    MEDIA_RESOLUTIONS_BEYOND_TILES,
    REFERRED_IMAGE_TYPES,
    REFERRED_MIME_PREFIXES,
    TEXT_MIME_PREFIX,
    THINKING_LEAST_MAX,
    image_size,
    image_tokens,
)
from core.formats.schema import (
    BOOLEAN,
    JSON_SCHEMA,
    STRING,
    TOKENS,
    Schema,
    any_of,
    array,
    object_of,
)
from core.ledger import Upstream
from core.limits import TOKENS_MAX
from core.prices import Usage
from core.prices.bundled import gemini_family

# The key goes in x-goog-api-key, as the google-genai SDK sends it. Its URL is an upstream's
# (CEILING_UPSTREAMS, api `gemini`), which names the key's setting too: until the routes read
# them, the provider has no URL of its own.
GOOGLE = Provider(Upstream.GOOGLE, "CEILING_UPSTREAMS",
                  "https://generativelanguage.googleapis.com", lambda config: None,
                  lambda config: None, ("x-goog-api-key", ""), ("x-goog-",))

# The top-level fields whose cost the gateway knows: the prompt (contents, systemInstruction),
# tools (checked by kind below), tool and safety settings (text), generationConfig (checked
# field by field below) and cachedContent (held at the window). Any other is refused by name.
GEMINI_FIELDS = frozenset({
    "contents", "systemInstruction", "tools", "toolConfig", "safetySettings",
    "generationConfig", "cachedContent",
})
# A countTokens body may give its request whole instead of its contents.
COUNT_REQUEST_FIELD = "generateContentRequest"
# generationConfig's fields that change nothing the worst case leaves out (sampling, stops,
# structured output's schema, which is text the body carries, logprobs, which lengthen only the
# answer's body) or that it reads (the caps, candidateCount, thinking, media resolution: an image
# is held by its tiles only at a resolution the tiles bound, gemini_tokens.py). responseModalities
# is read (text only); speechConfig and imageConfig ask for audio or image output, billed at rates
# the request cannot bound: refused, as is any field newer than this list.
GENERATION_FIELDS = frozenset({
    "stopSequences", "responseMimeType", "responseSchema", "responseJsonSchema",
    "candidateCount", "maxOutputTokens", "temperature", "topP", "topK", "seed",
    "presencePenalty", "frequencyPenalty", "responseLogprobs", "logprobs", "thinkingConfig",
    "mediaResolution", "enableEnhancedCivicAnswers", "responseModalities",
})
THINKING_FIELDS = frozenset({"thinkingBudget", "thinkingLevel", "includeThoughts"})
TEXT_MODALITY = "TEXT"
# generationConfig.candidateCount: Google serves 1 to 8 answers a call; each is held.
CANDIDATES_MAX = 8
CAP_FIELD = "maxOutputTokens"
CAP_PATH = f"generationConfig.{CAP_FIELD}"
BUDGET_PATH = "generationConfig.thinkingConfig.thinkingBudget"
# thinkingBudget -1: the model picks its budget ("dynamic thinking").
DYNAMIC_BUDGET = -1

# Tools: functions the client runs (their declarations are text the body carries); Google
# Search grounding (googleSearchRetrieval is its 1.5-era name), a fee per grounded prompt or
# search query, and its results as input; code execution, whose code and results are input of
# a size the request does not show, and URL context, whose fetched pages are: both held at the
# window. Others (Google Maps, file search, computer use, enterprise search) bill what nothing in
# the request bounds: refused.
CLIENT_TOOL_KEYS = frozenset({"functionDeclarations"})
SEARCH_TOOL_KEYS = frozenset({"googleSearch", "googleSearchRetrieval"})
REFERRING_TOOL_KEYS = frozenset({"codeExecution", "urlContext"})
# Models billed a fee per grounded prompt (Google, "Gemini Developer API pricing": Gemini 2.5
# and earlier, "$35 / 1,000 grounded prompts"), and their versions; any other a fee per search
# query ("$14 / 1,000 search queries"), of which Google documents no most per prompt.
SEARCH_PER_PROMPT_MODELS = GEMINI_BEFORE_3

# A model id as Google names them (gemini-2.5-pro, gemini-2.5-flash-preview-09-2025): it is put
# into the provider's path, so nothing that could leave the path segment (a slash, `:`, `?`,
# `%`, `..`) is taken.
MODEL_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")

# A Content's fields, and a Part's: its data (one of them) and its metadata.
CONTENT_FIELDS = frozenset({"role", "parts"})
PART_FIELDS = frozenset({
    "text", "inlineData", "fileData", "functionCall", "functionResponse", "executableCode",
    "codeExecutionResult", "thought", "thoughtSignature", "videoMetadata", "mediaResolution",
})


def check_model_id(model: str) -> str:
    """The model a route read from its path, checked to be an id the provider's path can carry
    as it is (the route puts it into `api`'s and `count_path`'s `{model}`)."""
    if ".." in model or not MODEL_ID.fullmatch(model):
        raise InvalidRequest(
            f"model {model[:64]!r} is not a Gemini model id (lowercase letters, digits, '.', "
            "'-' and '_')", field="model")
    return model


# -- its input ----------------------------------------------------------------------------------


class GeminiWalk(Walk):
    """A Gemini request's media: Walk's, and the tokens of its images, text files and blobs
    counted here by Google's rules (added to its text's bound)."""

    def __init__(self, model: str, tiled: bool) -> None:
        """`tiled`: whether an image is counted by its tiles (IMAGE_TILE_MODELS, at a media
        resolution the tiles bound), else held at the window."""
        super().__init__()
        self.model = model
        self.tiled = tiled
        self.media_tokens = 0

    def part(self, part: object, field: str) -> object:
        if not isinstance(part, dict):
            raise InputUnbounded(f"{field} must be a part object", field=field)
        for key in part:
            if key not in PART_FIELDS:
                raise InputUnbounded(
                    f"{field}.{key} is not a part field the gateway knows: what it bills "
                    "cannot be bounded", field=f"{field}.{key}")
        copy = dict(part)
        tiled = self.tiled
        if part.get("mediaResolution") is not None:
            level = part["mediaResolution"]
            where = f"{field}.mediaResolution"
            if not isinstance(level, dict) or set(level) != {"level"}:
                raise InvalidRequest(f"{where} must be an object of its level", field=where)
            tiled = tiled and media_resolution(level["level"], where) not in (
                MEDIA_RESOLUTIONS_BEYOND_TILES)
        if part.get("thoughtSignature") is not None:
            # The thinking of an earlier turn, encrypted: billed as what it carries, which its
            # bytes do not bound; held at the model's output limit (core/prices/).
            self.thinking_blocks += 1
            self.thinking_field = self.thinking_field or f"{field}.thoughtSignature"
            copy["thoughtSignature"] = ""
        if "inlineData" in part:
            copy["inlineData"] = self.inline(part["inlineData"], f"{field}.inlineData", tiled)
        if "fileData" in part:
            # A file uploaded to Google or a URL: input of a size the request does not show.
            self.refer(f"{field}.fileData")
            copy["fileData"] = {}
        response = part.get("functionResponse")
        if isinstance(response, dict) and response.get("parts") is not None:
            copy["functionResponse"] = {**response, "parts": self.parts(
                response["parts"], f"{field}.functionResponse.parts")}
        return copy

    def parts(self, parts: object, field: str) -> list[object]:
        if not isinstance(parts, list):
            raise InputUnbounded(f"{field} must be a list of parts", field=field)
        return [self.part(p, f"{field}[{j}]") for j, p in enumerate(parts)]

    def inline(self, blob: object, field: str, tiled: bool) -> dict[str, Any]:
        """An inline blob: counted by its kind's rule (an image by its tiles where `tiled`),
        and blanked."""
        if not isinstance(blob, dict) or set(blob) - {"mimeType", "data"}:
            raise InputUnbounded(f"{field} must be an object of mimeType and data", field=field)
        mime = blob.get("mimeType")
        data = blob.get("data")
        if not isinstance(mime, str) or not isinstance(data, str) or not data or not (
                encodable(data)):
            raise InvalidRequest(f"{field} must give a mimeType and base64 data", field=field)
        mime = mime.lower().split(";")[0].strip()
        if mime.startswith("image/"):
            if tiled and mime not in REFERRED_IMAGE_TYPES:
                width, height = image_size(data, f"{field}.data")
                self.media_tokens += image_tokens(width, height)
                self.image_field = self.image_field or field
            else:
                self.refer(field)
        elif mime in AUDIO_FORMATS:
            self.audio_ms += audio_ms_max(data, AUDIO_FORMATS[mime], field)
            self.audio_field = self.audio_field or field
        elif mime.startswith(TEXT_MIME_PREFIX):
            # Text: its decoded bytes bound its tokens (every 4 characters decode to 3 bytes).
            self.media_tokens += (len(data) + 3) // 4 * 3
        elif mime.startswith(REFERRED_MIME_PREFIXES):
            self.refer(field)
        else:
            raise InputUnbounded(
                f"{field}.mimeType {mime!r} is not a kind the gateway knows how Google bills",
                field=f"{field}.mimeType")
        return {"mimeType": mime, "data": ""}

    def turn(self, content: object, field: str) -> dict[str, Any]:
        """A Content: its parts copied with their media counted and blanked."""
        if not isinstance(content, dict):
            raise InvalidRequest(f"{field} must be a content object", field=field)
        for key in content:
            if key not in CONTENT_FIELDS:
                raise InputUnbounded(f"{field}.{key} is not a content field the gateway knows",
                                     field=f"{field}.{key}")
        return {**content, "parts": self.parts(content.get("parts"), f"{field}.parts")}


def media_resolution(level: object, field: str) -> str | None:
    """A media resolution Google names (MEDIA_RESOLUTIONS), or None where none is given."""
    if level is not None and not (isinstance(level, str) and level in MEDIA_RESOLUTIONS):
        raise InvalidRequest(f"{field} must be one of {', '.join(sorted(MEDIA_RESOLUTIONS))}",
                             field=field)
    return level


def gemini_input(body: dict[str, Any], model: str) -> tuple[InputBound, GeminiWalk]:
    """The bound of a request's contents and system instruction: their text by bytes, a
    framing allowance a turn, their media by Google's rules."""
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise InvalidRequest("contents must be a list of at least one content", field="contents")
    config = body.get("generationConfig")
    level = media_resolution(config.get("mediaResolution") if isinstance(config, dict)
                             else None, "generationConfig.mediaResolution")
    walk = GeminiWalk(model, gemini_family(model, IMAGE_TILE_MODELS) is not None
                      and level not in MEDIA_RESOLUTIONS_BEYOND_TILES)
    tokens = 0
    system = body.get("systemInstruction")
    if system is not None:
        tokens += TOKENS_PER_MESSAGE + json_bytes(walk.turn(system, "systemInstruction"))
    for i, content in enumerate(contents):
        tokens += TOKENS_PER_MESSAGE + json_bytes(walk.turn(content, f"contents[{i}]"))
    tokens += walk.media_tokens
    if tokens > TOKENS_MAX:
        raise InvalidRequest("contents are larger than any model's context", field="contents")
    return InputBound(tokens, walk.media()), walk


# -- what it asks for -----------------------------------------------------------------------------


def _generation(body: dict[str, Any]) -> dict[str, Any]:
    config = body.get("generationConfig")
    if config is None:
        config = body["generationConfig"] = {}
    if not isinstance(config, dict):
        raise InvalidRequest("generationConfig must be an object", field="generationConfig")
    for key in config:
        if key not in GENERATION_FIELDS:
            raise InputUnbounded(
                f"generationConfig.{key} is not a field the gateway forwards: what it bills is "
                "not known (audio or image output, or a setting newer than the gateway)",
                field=f"generationConfig.{key}")
    modalities = config.get("responseModalities")
    if modalities is not None and (not isinstance(modalities, list) or any(
            m != TEXT_MODALITY for m in modalities)):
        raise InvalidRequest(
            "generationConfig.responseModalities other than TEXT are not supported: audio and "
            "image output are billed at rates the gateway cannot bound from the request",
            field="generationConfig.responseModalities")
    return config


def thinking_tokens(config: dict[str, Any], model: str) -> int:
    """The most thinking tokens a call may be billed for beyond its maxOutputTokens."""
    thinking = config.get("thinkingConfig")
    if thinking is None:
        thinking = {}
    if not isinstance(thinking, dict):
        raise InvalidRequest("generationConfig.thinkingConfig must be an object",
                             field="generationConfig.thinkingConfig")
    _camel_case(thinking, "generationConfig.thinkingConfig")
    for key in thinking:
        if key not in THINKING_FIELDS:
            raise InputUnbounded(f"generationConfig.thinkingConfig.{key} is not a field the "
                                 "gateway knows", field=f"generationConfig.thinkingConfig.{key}")
    family = gemini_family(model, GEMINI_THINKING)
    rule = None if family is None else GEMINI_THINKING[family]
    budget = thinking.get("thinkingBudget")
    if budget is not None and thinking.get("thinkingLevel") is not None:
        raise InvalidRequest("give thinkingBudget or thinkingLevel, not both", field=BUDGET_PATH)
    if budget is not None and (type(budget) is not int or budget < DYNAMIC_BUDGET):
        raise InvalidRequest(f"{BUDGET_PATH} must be -1 (dynamic), 0 or a token count",
                             field=BUDGET_PATH)
    if type(budget) is int and budget != DYNAMIC_BUDGET:
        if rule is None or budget == 0:
            return budget
        if budget > rule.most:
            raise InputUnbounded(
                f"{BUDGET_PATH} ({budget}) is above model {model!r}'s documented most "
                f"({rule.most}): the gateway holds the thinking a model can bill, and this one "
                "is not documented to stop there", field=BUDGET_PATH, model=model)
        # Below the model's range, Google may raise it to the range's least.
        return max(budget, rule.least)
    if rule is None:
        raise InputUnbounded(
            f"model {model!r} has no documented most thinking tokens the gateway knows, and "
            f"the request sets no {BUDGET_PATH}: send a budget (0 turns thinking off on models "
            "that allow it)", field=BUDGET_PATH, model=model)
    # A model that does not think by default thinks when the request asks: by a level, a
    # dynamic budget, or for its thoughts (includeThoughts), which a model may take as asking.
    asked = thinking.get("thinkingLevel") is not None or thinking.get("includeThoughts") is True
    if budget is None and not asked and not rule.by_default:
        return 0
    return rule.most


def _camel_case(fields: dict[str, Any], where: str) -> None:
    """`fields` (an object the body forwards) with its snake_case names in the camelCase read
    here, in place: Google's API takes both (proto JSON), and google-genai sends a
    thinkingConfig as snake_case. The body is forwarded as read, so the provider bills what
    was priced; a field given in both spellings is refused."""
    for key in [k for k in fields if "_" in k]:
        head, *rest = key.split("_")
        camel = head + "".join(word.capitalize() for word in rest)
        if camel in fields:
            raise InvalidRequest(f"{where}: give {camel} or {key}, not both",
                                 field=f"{where}.{camel}")
        fields[camel] = fields.pop(key)


def _tools(tools: object) -> tuple[str, str]:
    """Check a call's tools: the first Google Search tool's field, and the first tool's whose
    results are input of a size the request does not show."""
    if tools is None:
        return "", ""
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", field="tools")
    search, referring = "", ""
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not tool:
            raise InputUnbounded(f"{where} must be a tool object", field=where)
        for key in tool:
            if key in CLIENT_TOOL_KEYS:
                continue
            if key in SEARCH_TOOL_KEYS:
                search = search or f"{where}.{key}"
            elif key in REFERRING_TOOL_KEYS:
                referring = referring or f"{where}.{key}"
            else:
                raise InputUnbounded(
                    f"{where}.{key} is a tool the gateway does not forward: it bills what "
                    "nothing in the request bounds (functions, Google Search, code execution "
                    "and URL context are forwarded)", field=f"{where}.{key}")
    return search, referring


# -- its usage ----------------------------------------------------------------------------------


def _modality(details: object, modality: str) -> int:
    if details is None:
        return 0
    if not isinstance(details, list):
        raise ValueError("token details must be a list")
    return sum(count(d.get("tokenCount")) for d in details
               if isinstance(d, dict) and d.get("modality") == modality)


def read_gemini_usage(usage: object, searches: int = 0) -> Usage | None:
    """Google's usageMetadata: the prompt (cached content included) and the tool-use prompt
    (search results, fetched pages, code results) are input; the answer and the thoughts are
    output, billed at the output rate; cached content is read at the cached rate; audio input
    at the audio rate. A total above those is output left out (the reading that costs more).
    None if it cannot be read (the call is then settled from its bound)."""
    if not isinstance(usage, dict):
        return None
    try:
        prompt = count(usage.get("promptTokenCount"))
        tool_use = count(usage.get("toolUsePromptTokenCount"))
        input_tokens = prompt + tool_use
        output_tokens = count(usage.get("candidatesTokenCount")) + count(
            usage.get("thoughtsTokenCount"))
        total = usage.get("totalTokenCount")
        if type(total) is int and total - input_tokens > output_tokens:
            output_tokens = total - input_tokens
        audio_in = _modality(usage.get("promptTokensDetails"), "AUDIO") + _modality(
            usage.get("toolUsePromptTokensDetails"), "AUDIO")
        audio_out = _modality(usage.get("candidatesTokensDetails"), "AUDIO")
        return Usage(input_tokens, output_tokens, count(usage.get("cachedContentTokenCount")),
                     input_audio_tokens=audio_in, output_audio_tokens=audio_out,
                     web_search_requests=searches)
    except (ValueError, AttributeError, InvalidRequest):
        return None


def _search_queries(candidates: object) -> tuple[bool, int]:
    """Whether an answer's candidates were grounded in Google Search, and how many queries
    they ran (their groundingMetadata)."""
    grounded, queries = False, 0
    for candidate in candidates if isinstance(candidates, list) else ():
        metadata = candidate.get("groundingMetadata") if isinstance(candidate, dict) else None
        if not isinstance(metadata, dict):
            continue
        found = metadata.get("webSearchQueries")
        ran = len(found) if isinstance(found, list) else 0
        grounded = grounded or ran > 0 or metadata.get("searchEntryPoint") is not None
        queries += ran
    return grounded, queries


def searches_billed(model_version: object, grounded: bool, queries: int) -> int:
    """The search fees an answer is billed: one per grounded prompt for a model billed so, else
    one per query (and at least one where it was grounded). An answer that names no model is
    read per query, the reading that costs more."""
    if not grounded:
        return 0
    # Google names the model as its path does, or as a resource (models/gemini-2.5-flash).
    if isinstance(model_version, str) and gemini_family(
            model_version.removeprefix("models/"), SEARCH_PER_PROMPT_MODELS):
        return 1
    return max(queries, 1)


# -- its errors -----------------------------------------------------------------------------------

# The gateway's error code -> Google's canonical status, and the HTTP code Google answers it
# with (https://ai.google.dev/gemini-api/docs/troubleshooting; google.rpc.Code). A budget that
# cannot pay is FAILED_PRECONDITION, Google's own answer to an account without billing: a
# RESOURCE_EXHAUSTED is a rate limit clients retry. Every code api/errors.py knows has one
# (tests/core/formats/test_gemini.py).
GOOGLE_STATUSES: dict[str, tuple[str, int]] = {
    "invalid_request": ("INVALID_ARGUMENT", 400),
    "model_unpriced": ("INVALID_ARGUMENT", 400),
    "input_unbounded": ("INVALID_ARGUMENT", 400),
    "model_unbounded": ("INVALID_ARGUMENT", 400),
    "field_unsupported": ("INVALID_ARGUMENT", 400),
    "model_not_routed": ("INVALID_ARGUMENT", 400),
    "unauthorized": ("UNAUTHENTICATED", 401),
    "forbidden": ("PERMISSION_DENIED", 403),
    "budget_not_found": ("NOT_FOUND", 404),
    "reservation_not_found": ("NOT_FOUND", 404),
    "not_found": ("NOT_FOUND", 404),
    "method_not_allowed": ("UNIMPLEMENTED", 501),
    "payload_too_large": ("INVALID_ARGUMENT", 400),
    "budget_exceeded": ("FAILED_PRECONDITION", 400),
    "budget_busy": ("RESOURCE_EXHAUSTED", 429),
    "state_quota": ("RESOURCE_EXHAUSTED", 429),
    "rate_limited": ("RESOURCE_EXHAUSTED", 429),
    "concurrency_limited": ("RESOURCE_EXHAUSTED", 429),
    "users_exhausted": ("PERMISSION_DENIED", 403),
    "model_not_allowed": ("PERMISSION_DENIED", 403),
    "user_required": ("INVALID_ARGUMENT", 400),
    "budget_paused": ("FAILED_PRECONDITION", 400),
    "idempotency_conflict": ("ABORTED", 409),
    "idempotency_in_flight": ("ABORTED", 409),
    "reply_not_kept": ("ABORTED", 409),
    "reservation_resolved": ("FAILED_PRECONDITION", 400),
    "operation_refused": ("FAILED_PRECONDITION", 400),
    "budget_in_use": ("FAILED_PRECONDITION", 400),
    "ledger_not_empty": ("FAILED_PRECONDITION", 400),
    "upstream_unreachable": ("UNAVAILABLE", 503),
    "upstream_timeout": ("DEADLINE_EXCEEDED", 504),
    "upstream_answer_too_large": ("INTERNAL", 500),
    "cost_report_failed": ("INTERNAL", 500),
    "ledger_unavailable": ("UNAVAILABLE", 503),
    "ledger_not_shared": ("UNAVAILABLE", 503),
    "invalid_configuration": ("UNAVAILABLE", 503),
    "invariant_broken": ("INTERNAL", 500),
}
GOOGLE_STATUS_DEFAULT = ("INTERNAL", 500)
ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo"
ERROR_DOMAIN = "spend-ceiling"


def google_shape(error: dict[str, Any]) -> dict[str, Any]:
    """{"error": {"code", "message", "status", "details": [ErrorInfo]}}: what Google's clients
    parse. The gateway's code is the ErrorInfo's `reason` and its details its `metadata`
    (strings, as google.rpc.ErrorInfo has them)."""
    error = dict(error)
    code = error.pop("code")
    error.pop("type", None)
    message = error.pop("message")
    status, http_code = GOOGLE_STATUSES.get(code, GOOGLE_STATUS_DEFAULT)
    metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in error.items()}
    return {"error": {"code": http_code, "message": message, "status": status, "details": [
        {"@type": ERROR_INFO_TYPE, "reason": code, "domain": ERROR_DOMAIN,
         "metadata": metadata}]}}


# -- its body, for the OpenAPI document (core/formats/schema.py) ----------------------------------

TEXT_PART = object_of({"text": STRING, "thought": BOOLEAN, "thoughtSignature": STRING},
                      ("text",))
INLINE_PART = object_of({"inlineData": object_of({
    "mimeType": {"type": "string", "description": "image/png, image/jpeg, image/gif, "
                 "image/webp, audio/wav, audio/mp3, text/*; a video, a PDF or other audio is "
                 "held at the model's context window"},
    "data": {"type": "string", "description": "base64"},
}, ("mimeType", "data"), more=False)}, ("inlineData",))
FUNCTION_PARTS = any_of(
    object_of({"functionCall": object_of({"name": STRING, "args": {"type": "object"}},
                                         ("name",)), "thoughtSignature": STRING},
              ("functionCall",)),
    object_of({"functionResponse": object_of({"name": STRING, "response": {"type": "object"}},
                                             ("name", "response"))}, ("functionResponse",)),
)
CONTENT = object_of({
    "role": {"type": "string", "enum": ["user", "model"]},
    "parts": array(any_of(TEXT_PART, INLINE_PART, FUNCTION_PARTS), min_items=1),
}, ("parts",), more=False)
GEMINI_TOOL = object_of({
    "functionDeclarations": array(object_of({"name": STRING, "description": STRING,
                                             "parameters": JSON_SCHEMA}, ("name",))),
    "googleSearch": {"type": "object", "description": "a fee per grounded prompt (Gemini 2.x) "
                     "or per search query (later models: needs web_searches_max in the prices "
                     "file); its results are held at the context window"},
}, more=False)

GEMINI_BODY: Schema = object_of({
    "contents": array(CONTENT, min_items=1),
    "systemInstruction": CONTENT,
    "tools": array(GEMINI_TOOL),
    "toolConfig": {"type": "object"},
    "safetySettings": array({"type": "object"}),
    "generationConfig": object_of({
        "maxOutputTokens": {**TOKENS, "description": "with none, the gateway sends its default "
                            "cap; thinking is held on top of it"},
        "candidateCount": {"type": "integer", "minimum": 1, "maximum": CANDIDATES_MAX},
        "temperature": {"type": "number"}, "topP": {"type": "number"},
        "topK": {"type": "integer"}, "stopSequences": array(STRING),
        "responseMimeType": STRING, "responseSchema": {"type": "object"},
        "thinkingConfig": object_of({
            "thinkingBudget": {"type": "integer", "minimum": DYNAMIC_BUDGET,
                               "description": "held on top of maxOutputTokens; -1 (dynamic) "
                               "and none are held at the model's documented most, a budget "
                               "below its documented range at the range's least"},
            "thinkingLevel": {"type": "string", "enum": ["minimal", "low", "medium", "high"]},
            "includeThoughts": BOOLEAN,
        }, more=False),
        "responseModalities": array({"type": "string", "enum": [TEXT_MODALITY]}),
    }, more=False),
    "cachedContent": {"type": "string", "description": "cachedContents/{id}: held at the "
                      "model's context window"},
}, ("contents",), more=False)
HEADER_SCHEMAS: dict[str, Schema] = {
    "x-goog-api-key": {"type": "string",
                       "description": "the API key, when neither Authorization nor ?key= is "
                       "sent"},
}

# -- the format ---------------------------------------------------------------------------------


class Gemini(WireFormat):
    """generateContent, or with `stream` streamGenerateContent (server-sent events)."""

    provider = GOOGLE
    body_schema = GEMINI_BODY
    cap_fields = (CAP_FIELD,)
    allowed_fields = GEMINI_FIELDS | {COUNT_REQUEST_FIELD}
    key_header = "x-goog-api-key"
    key_query = "key"
    model_in_path = True
    count_path = "v1beta/models/{model}:countTokens"
    # `:path`: the model may be `<upstream>/<model>` (core/upstreams.py), which the SDK sends
    # with its slash as it is; the path's last `:countTokens` ends the model.
    count_route = "/v1beta/models/{model:path}:countTokens"
    count_name = "gemini_count_tokens"
    routed_as = "gemini"
    # The google-genai SDK's default v1beta, and v1 (the upstream is called at its own:
    # api/upstreams/gemini.py).
    path_versions = ("v1beta", "v1")
    header_schemas = HEADER_SCHEMAS
    # google-genai parses every non-empty line of a stream as an event: a comment breaks it.
    stream_trailer = False
    usage_fields = ("promptTokenCount", "candidatesTokenCount", "promptTokensDetails",
                    "candidatesTokensDetails")

    def __init__(self, stream: bool) -> None:
        super().__init__()
        self.stream = stream
        self.api = Api.GEMINI_STREAM if stream else Api.GEMINI
        verb = "streamGenerateContent" if stream else "generateContent"
        self.route = f"/v1beta/models/{{model:path}}:{verb}"  # `:path`: as count_route's
        self.name = "gemini_stream_generate_content" if stream else "gemini_generate_content"

    def plan(self, body: dict[str, Any], model: str, headers: tuple[tuple[str, str], ...],
             output_tokens_default: int, betas_allowed: frozenset[str] = frozenset()) -> Plan:
        check_model_id(model)
        if body.get(COUNT_REQUEST_FIELD) is not None:
            raise InvalidRequest(f"{COUNT_REQUEST_FIELD} is a countTokens field",
                                 field=COUNT_REQUEST_FIELD)
        config = _generation(body)
        search_field, referring_field = _tools(body.get("tools"))
        prompt, _ = gemini_input(body, model)
        added = self.cap_added(body, output_tokens_default)
        cap = self.output_cap(body, output_tokens_default)
        thinking = thinking_tokens(config, model)
        candidates = config.get("candidateCount")
        choices = 1 if candidates is None else positive_int(candidates,
                                                            "generationConfig.candidateCount")
        if choices > CANDIDATES_MAX:
            raise InvalidRequest(
                f"generationConfig.candidateCount must be at most {CANDIDATES_MAX}",
                field="generationConfig.candidateCount")
        media = prompt.media
        cached = body.get("cachedContent")
        if cached is not None:
            if not isinstance(cached, str) or not cached:
                raise InvalidRequest("cachedContent must name a cached content",
                                     field="cachedContent")
            media = replace(media, referred_field=media.referred_field or "cachedContent")
        if referring_field and not media.referred_field:
            media = replace(media, referred_field=referring_field)
        if search_field:
            # Per grounded prompt: one fee a call. Per query: as many as the prices file's
            # web_searches_max (core/prices/ refuses the call without it).
            per_prompt = gemini_family(model, SEARCH_PER_PROMPT_MODELS) is not None
            media = replace(media, web_searches=1 if per_prompt else 0,
                            web_search_field=search_field,
                            web_search_runs=1 if per_prompt else choices)
        # Only where the request asks for them can Google bill 1-hour cache writes: it has none
        # (a cache is written by cachedContents.create, not by this call).
        media = replace(media, cache_1h=False)
        text_tokens_max = prompt.text_tokens + json_bytes(
            {k: v for k, v in body.items() if k not in ("contents", "systemInstruction")})
        return Plan(self, model, body, self.stream, text_tokens_max, cap + thinking, choices,
                    False, media, bounds_added=added)

    def count_checked(self, body: dict[str, Any], headers: tuple[tuple[str, str], ...],
                      betas_allowed: frozenset[str]) -> None:
        """A countTokens body gives contents, or a whole generateContent request (which names
        its model, as models/{model})."""
        inner = body.get(COUNT_REQUEST_FIELD)
        if inner is None:
            return
        if not isinstance(inner, dict):
            raise InvalidRequest(f"{COUNT_REQUEST_FIELD} must be an object",
                                 field=COUNT_REQUEST_FIELD)
        for field in inner:
            if field not in GEMINI_FIELDS and field != "model":
                raise InputUnbounded(f"{COUNT_REQUEST_FIELD}.{field} is not a field the "
                                     "gateway forwards", field=f"{COUNT_REQUEST_FIELD}.{field}")

    def _config(self, body: dict[str, Any]) -> dict[str, Any]:
        config = body.get("generationConfig")
        return config if isinstance(config, dict) else {}

    def cap_added(self, body: dict[str, Any], output_tokens_default: int) -> Bounds:
        if self._config(body).get(CAP_FIELD) is not None:
            return ()
        return ((CAP_PATH, output_tokens_default),)

    def output_cap(self, body: dict[str, Any], output_tokens_default: int) -> int:
        config = self._config(body)
        if config.get(CAP_FIELD) is None:
            body["generationConfig"] = {**config, CAP_FIELD: output_tokens_default}
            return output_tokens_default
        return positive_int(config[CAP_FIELD], CAP_PATH)

    def clamped_body(self, body: dict[str, Any], output_tokens_max: int) -> dict[str, Any]:
        """maxOutputTokens and the thinking together within `output_tokens_max`: thinking,
        where the body lets the model think, set to a budget of half of it or the body's own if
        smaller, yet at least THINKING_LEAST_MAX (0 where that leaves no cap; a level replaced
        by that budget, which Gemini 3 takes too), the answer's cap the rest. A body
        without thinkingConfig gets that budget too, since a model may think by default: on a
        model that thinks only when asked (Flash-Lite) it then thinks within it; one that cannot
        think (2.0) refuses it, unbilled, and the hold is released."""
        config = dict(self._config(body))
        thinking = dict(config.get("thinkingConfig") or {})
        budget = thinking.get("thinkingBudget")
        if budget == 0:
            config[CAP_FIELD] = output_tokens_max
        else:
            half = output_tokens_max // 2
            new_budget = min(budget, half) if type(budget) is int and budget > 0 else half
            # Not below any model's least (a model may raise it there, past the clamp); where
            # that leaves no cap, thinking off: 0, which a model that cannot stop thinking
            # (2.5 Pro) refuses unbilled.
            new_budget = max(new_budget, THINKING_LEAST_MAX)
            if new_budget >= output_tokens_max:
                new_budget = 0
            thinking.pop("thinkingLevel", None)
            config["thinkingConfig"] = {**thinking, "thinkingBudget": new_budget}
            config[CAP_FIELD] = output_tokens_max - new_budget
        return {**body, "generationConfig": config}

    def answer_usage(self, doc: dict[str, Any]) -> Usage | None:
        grounded, queries = _search_queries(doc.get("candidates"))
        return read_gemini_usage(doc.get("usageMetadata"),
                                 searches_billed(doc.get("modelVersion"), grounded, queries))

    def usage_of(self, usage: object, service_tier: object = None) -> Usage | None:
        return read_gemini_usage(usage)

    def stream_event(self, tally: StreamTally, doc: dict[str, Any]) -> bool:
        # Every chunk is a GenerateContentResponse; its usageMetadata is cumulative (the last
        # one covers the call). The stream is over once every candidate asked for has a
        # finishReason (or the prompt was blocked) and usage came: with candidateCount above 1,
        # the first candidate's end comes before the others' tokens are counted.
        reported = tally.reported
        if isinstance(doc.get("usageMetadata"), dict):
            reported["usageMetadata"] = doc["usageMetadata"]
        if isinstance(doc.get("modelVersion"), str):
            reported["modelVersion"] = doc["modelVersion"]
        candidates = doc.get("candidates")
        grounded, queries = _search_queries(candidates)
        if grounded:
            reported["grounded"] = True
            reported["queries"] = max(reported.get("queries", 0), queries)
        finished: set[object] = reported.setdefault("finished", set())
        for candidate in candidates if isinstance(candidates, list) else ():
            if isinstance(candidate, dict) and candidate.get("finishReason"):
                finished.add(candidate.get("index", 0))
        feedback = doc.get("promptFeedback")
        if len(finished) >= tally.plan.choices or (
                isinstance(feedback, dict) and feedback.get("blockReason")):
            reported["ended"] = True
        if reported.get("ended") and "usageMetadata" in reported:
            tally.finished = True
            tally.usage = read_gemini_usage(reported["usageMetadata"], searches_billed(
                reported.get("modelVersion"), bool(reported.get("grounded")),
                reported.get("queries", 0)))
        return True

    def error_body(self, error: dict[str, Any]) -> dict[str, Any]:
        return google_shape(error)

    def error_event(self, error: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(google_shape(error)).encode() + b"\n\n"

    def error_status(self, shaped: dict[str, Any], status: int) -> int:
        # Google's clients read the status and the body's `code` as one: the body's is sent.
        code = shaped["error"]["code"]
        return code if type(code) is int else status


GEMINI = Gemini(stream=False)
GEMINI_STREAM = Gemini(stream=True)
