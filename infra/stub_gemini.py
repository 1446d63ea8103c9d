"""Google's Gemini API on the stub provider: the witness for a gateway's Gemini routes, billing
from the stub's own table (infra/stub_prices.py, a model's `gemini` entry) by its own counting
(infra/stub_tokens.py's text rule). Vertex AI serves the same API behind its own token
(infra/stub_vertex.py).

  POST /{v1beta|v1}/models/{model}:generateContent | :streamGenerateContent?alt=sse | :countTokens
      the key in `x-goog-api-key` or `?key=` (checked when the stub has one)

Errors in Google's shape `{"error": {"code", "message", "status"}}`: an unknown model 404
NOT_FOUND, a wrong key 400 INVALID_ARGUMENT (none: 403 PERMISSION_DENIED), a prompt above the
model's window 400 INVALID_ARGUMENT, an unknown field (camelCase or snake_case, top level or in
generationConfig) 400 INVALID_ARGUMENT as Google's parser answers it, an answer asked in images
or speech 400; none billed. A stream needs `?alt=sse` (the SDKs send it;
the stub does not serve the JSON-array stream).

Counting (the stub's own rule where Google documents none to the token): text by UTF-8 bytes over
four, 4 tokens a content and 3 for the reply, function declarations, calls, responses and a response
schema by their JSON; images 258 tokens when both sides are at most 384 px, else 258 a 768 x 768
tile (https://ai.google.dev/gemini-api/docs/tokens, "multimodal tokens"), or where the request
names a media resolution Google's Gemini 2.5 figure for it (IMAGE_TOKENS_BY_RESOLUTION); audio
(WAV, MP3) 32 tokens a second; a PDF 258 a page
(https://ai.google.dev/gemini-api/docs/document-processing); on Gemini 3 (a table entry with
`media_tokens`) an image or a PDF page costs its media resolution's tokens (the part's
`mediaResolution.level`, else the request's `generationConfig.mediaResolution`, else high for an
image and medium for a PDF; https://ai.google.dev/gemini-api/docs/media-resolution); `fileData` by
its URI from /control's `files` registry (unknown: refused); `cachedContent` by its name from
/control's `cached_contents` {name: {"model", "tokens"}} (unknown: 403 PERMISSION_DENIED). Thought
parts sent back are billed by their text; signatures are opaque and not billed. countTokens answers
the promptTokenCount generateContent would.

Billing (https://ai.google.dev/gemini-api/docs/pricing): prompt tokens at the input rate (audio
at the audio rate), cached tokens (named cached content, or implicit hits by the cached_tokens
fault) at the cache rate, the whole call at the long-context rates when its prompt is above the
model's threshold (200k on 2.5 Pro and 3 Pro), output and thinking at the output rate, URL
context content (`toolUsePromptTokenCount`: a URL in the prompt registered in /control's
`files`, by its bytes and pages; an unknown URL is a failed retrieval, 0 tokens) at the input
rate, and grounding with Google Search: once a grounded prompt (Gemini 2.5) or once a search
query (Gemini 3), every one, as though the free allowance were spent. codeExecution is accepted
and runs nothing.

Thinking: `thoughtsTokenCount` is billed at the output rate, as Google documents ("response
pricing is the sum of output tokens and thinking tokens",
https://ai.google.dev/gemini-api/docs/thinking#pricing). Whether thoughts count inside
`maxOutputTokens` Google does not document; its API serves them so (finishReason MAX_TOKENS
once thoughts + candidates reach it: googleapis/python-genai #782, #2062), and so does the stub
by default. /control's `thinking_outside_output_cap` (false) serves the other reading, the
answer alone capped and thinking beside it up to the budget, to test a gateway against both.
A call thinks half its answer (thinkingLevel: minimal 1/8, low 1/4, medium 1/2, high 3/4) at
most its budget (a positive budget below the model's documented range raised to the range's
least: https://ai.google.dev/gemini-api/docs/thinking gives the ranges, not what is done below
one, and the stub bills the dearer reading), or `X-Stub-Reasoning-Tokens: N` whatever the budget
(Google documents that the model may overflow it); `includeThoughts` shows a summary (a word
every four tokens); the first part after thinking carries a `thoughtSignature`.

A stream: a chunk a thought summary and a text piece; every chunk carries `usageMetadata` with
the prompt's counts, and only the last the candidates and thoughts (read it, not the first).

Faults as on every route (infra/stub_provider.py): `X-Stub-Web-Searches` (`web_searches`) is the
number of Google Search queries a grounded call runs (1 without it, 0: not grounded);
`X-Stub-Cached-Tokens` (`cached_tokens`) implicit cache hits; `X-Stub-Tool-Call: 1` calls the
first allowed function (as does mode ANY, with a minimal instance of its parameters); /control's
`tool_calls` queue scripts calls; `candidateCount` N bills every candidate; a fail after billing
on a stream answers its status before the first chunk.
"""

from __future__ import annotations

import base64
import json
import math
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infra.stub_bill import Usage
from infra.stub_faults import (
    Api,
    ApiError,
    Decided,
    Fault,
    count,
    header_count,
    pieces,
    read_body,
    sse,
    words,
)
from infra.stub_messages import schema_instance
from infra.stub_prices import (
    GEMINI_MEDIA_RESOLUTIONS,
    TIER_LONG_CONTEXT,
    TIER_STANDARD,
    GeminiModel,
    ModelPrices,
    cost_micros,
)
from infra.stub_tokens import (
    TOKENS_PER_MESSAGE,
    TOKENS_PER_REPLY,
    FileRef,
    InputError,
    audio_seconds,
    decode_base64,
    image_size,
    pdf_pages,
    read_at,
    text_tokens,
)

if TYPE_CHECKING:
    from infra.stub_provider import StubProviderApp

API_GEMINI = "gemini"
API_VERTEX_GEMINI = "vertex.gemini"
VERSIONS = ("v1beta", "v1")
ACTIONS = ("generateContent", "streamGenerateContent", "countTokens")
# Google's limit on a request with inline data (https://ai.google.dev/gemini-api/docs/
# image-understanding, "inline image data": 20 MB in all).
REQUEST_BYTES_MAX = 20 * 1024 * 1024
# Media tokens (https://ai.google.dev/gemini-api/docs/tokens): a small image, or each tile of a
# larger one, 258; audio 32 a second; a PDF page 258.
IMAGE_TOKENS = 258
IMAGE_SMALL_PX = 384
IMAGE_TILE_PX = 768
# An image on a tiled model (no `media_tokens` in its table entry) asked for at a media resolution:
# Google's figures for Gemini 2.5 (https://ai.google.dev/gemini-api/docs/media-resolution, "Token
# counts"): low 64, medium 256, high "256 + Pan & Scan (~2048)", read as 2,048 beyond the 256
# (the dearer reading). Ultra high is Gemini 3's; on a tiled model it is billed as high, the most
# Google names for one. With no level the image is billed by its tiles (/docs/tokens).
IMAGE_PAN_AND_SCAN_TOKENS = 2_048
IMAGE_TOKENS_BY_RESOLUTION = {"low": 64, "medium": 256, "high": 256 + IMAGE_PAN_AND_SCAN_TOKENS,
                              "ultra_high": 256 + IMAGE_PAN_AND_SCAN_TOKENS}
MEDIA_RESOLUTIONS = (*GEMINI_MEDIA_RESOLUTIONS, "ultra_high")
AUDIO_TOKENS_PER_S = 32
PDF_PAGE_TOKENS = 258
AUDIO_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav",
                 "audio/mp3": "mp3", "audio/mpeg": "mp3"}
# generationConfig.candidateCount: Google serves 1 to 8.
CANDIDATES_MAX = 8
# URL context reads at most 20 URLs a request (https://ai.google.dev/gemini-api/docs/
# url-context, "limitations").
URL_CONTEXT_URLS_MAX = 20
URL_PATTERN = re.compile(r"https?://[^\s\"'<>)]+")
# The share of an answer spent thinking: the stub's own, as on the other APIs; by thinkingLevel.
THINKING_SHARE = Fraction(1, 2)
THINKING_LEVEL_SHARES = {"minimal": Fraction(1, 8), "low": Fraction(1, 4),
                         "medium": Fraction(1, 2), "high": Fraction(3, 4)}
THINKING_LEVEL_DEFAULT = "high"  # Gemini 3's default (https://ai.google.dev/gemini-api/docs/
#                                   thinking, "thinking levels")
THINKING_BUDGET_DYNAMIC = -1
THINKING_TOKENS_PER_SUMMARY_WORD = 4
THINKING_WORDS = ("consider", "the", "budget", "before", "answering")
FUNCTION_MODES = ("AUTO", "ANY", "NONE", "VALIDATED")
# A GenerateContentRequest's fields (https://ai.google.dev/api/generate-content, and Vertex's
# `labels`), camelCase or snake_case; any other is refused, as Google's JSON parser does.
REQUEST_FIELDS = frozenset({"model", "contents", "tools", "toolConfig", "safetySettings",
                            "systemInstruction", "generationConfig", "cachedContent", "labels"})
GENERATION_CONFIG_FIELDS = frozenset({
    "stopSequences", "responseMimeType", "responseSchema", "responseJsonSchema",
    "responseModalities", "candidateCount", "maxOutputTokens", "temperature", "topP", "topK",
    "seed", "presencePenalty", "frequencyPenalty", "responseLogprobs", "logprobs",
    "enableEnhancedCivicAnswers", "speechConfig", "thinkingConfig", "mediaResolution",
    "imageConfig", "routingConfig", "audioTimestamp", "modelSelectionConfig"})
# Settings that answer in images or speech, which the stub's text models have no rate for.
OUTPUT_MEDIA_FIELDS = frozenset({"speechConfig", "imageConfig"})
# Each status's name in Google's error shape (google.rpc.Code).
STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                404: "NOT_FOUND", 409: "ABORTED", 413: "INVALID_ARGUMENT",
                429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
                501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
# /control fields this module reads.
CONTROL_FIELDS = frozenset({"cached_contents", "thinking_outside_output_cap"})
CACHED_CONTENTS_MAX = 10_000

def google_error(error: ApiError, headers: dict[str, str] | None = None) -> Response:
    status = STATUS_NAMES.get(error.status, "INVALID_ARGUMENT" if error.status < 500
                              else "INTERNAL")
    return JSONResponse({"error": {"code": error.status, "message": error.message,
                                   "status": status}}, status_code=error.status,
                        headers=headers)


def invalid(message: str) -> ApiError:
    return ApiError(400, message)


# -- counting ----------------------------------------------------------------------------------


@dataclass
class Prompt:
    """A request's input, counted, and what its tools let the model do."""

    text: int = 0
    image: int = 0
    audio: int = 0
    document: int = 0
    referenced: int = 0  # input by reference: files by URI, cached content
    cached: int = 0  # cached content's tokens (part of the total)
    functions: dict[str, Any] = field(default_factory=dict)  # name: parameters schema
    function_mode: str = "AUTO"
    allowed: tuple[str, ...] = ()
    google_search: bool = False
    url_context: bool = False
    urls: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.text + self.image + self.audio + self.document + self.cached

    def details(self) -> list[dict[str, Any]]:
        parts = (("TEXT", self.text + self.cached), ("IMAGE", self.image),
                 ("AUDIO", self.audio), ("DOCUMENT", self.document))
        return [{"modality": m, "tokenCount": n} for m, n in parts if n]


def gemini_image_tokens(width: int, height: int) -> int:
    if width <= IMAGE_SMALL_PX and height <= IMAGE_SMALL_PX:
        return IMAGE_TOKENS
    return IMAGE_TOKENS * math.ceil(width / IMAGE_TILE_PX) * math.ceil(height / IMAGE_TILE_PX)


def media_resolution(raw: object, where: str) -> str | None:
    """A mediaResolution (MEDIA_RESOLUTION_LOW, _MEDIUM, _HIGH, _ULTRA_HIGH) as a level; None:
    unspecified, the model's default."""
    if raw in (None, "MEDIA_RESOLUTION_UNSPECIFIED"):
        return None
    level = raw.removeprefix("MEDIA_RESOLUTION_").lower() if isinstance(raw, str) else None
    if level not in MEDIA_RESOLUTIONS:
        raise InputError(f"{where} must be MEDIA_RESOLUTION_LOW, _MEDIUM, _HIGH or _ULTRA_HIGH",
                         where)
    return level


def _part_resolution(part: dict[str, Any], where: str) -> str | None:
    """A part's own mediaResolution ({"level": ...}, Gemini 3), if it has one."""
    given = part.get("mediaResolution", part.get("media_resolution"))
    if given is None:
        return None
    if not isinstance(given, dict):
        raise InputError(f"{where}.mediaResolution must be an object with a level", where)
    return media_resolution(given.get("level"), f"{where}.mediaResolution.level")


def _json_tokens(value: object) -> int:
    return text_tokens(len(json.dumps(value, separators=(",", ":"),
                                      ensure_ascii=False).encode()))


class Counter:
    def __init__(self, app: StubProviderApp, model: GeminiModel, resolution: object) -> None:
        self.app, self.model = app, model
        self.resolution = media_resolution(resolution, "generationConfig.mediaResolution")
        self.prompt = Prompt()

    def media(self, mime: str, ref: FileRef | None, data: bytes | None, where: str,
              resolution: str | None = None) -> None:
        """One inline or referenced medium, by its type (and, on Gemini 3, the part's or the
        request's media resolution: an image high, a PDF page medium by default)."""
        level = resolution or self.resolution
        by_level = self.model.media_tokens
        if mime.startswith("image/"):
            if data is not None:
                with read_at(where):
                    _, (width, height) = image_size(data)
            elif ref is not None and ref.image is not None:
                width, height = ref.image
            else:
                raise InputError(f"{where}: the file is not an image the stub knows", where)
            if by_level is None:
                self.prompt.image += (gemini_image_tokens(width, height) if level is None
                                      else IMAGE_TOKENS_BY_RESOLUTION[level])
            else:
                self.prompt.image += self._by_level(by_level, level or "high", where)
        elif mime in AUDIO_FORMATS:
            if data is None:
                raise InputError(f"{where}: audio by reference is not served; send it inline",
                                 where)
            with read_at(where):
                seconds = audio_seconds(data, AUDIO_FORMATS[mime])
            self.prompt.audio += math.ceil(seconds * AUDIO_TOKENS_PER_S)
        elif mime == "application/pdf":
            pages = pdf_pages(data) if data is not None else (ref.pages if ref else 0)
            if not pages:
                raise InputError(f"{where}: the PDF has no pages", where)
            self.prompt.document += pages * (PDF_PAGE_TOKENS if by_level is None
                                             else self._by_level(by_level, level or "medium",
                                                                 where))
        elif mime.startswith("text/"):
            size = len(data) if data is not None else (ref.size_bytes if ref else 0)
            self.prompt.text += text_tokens(size)
        else:
            raise InputError(f"{where}: Unsupported MIME type: {mime}", where)

    @staticmethod
    def _by_level(by_level: Mapping[str, int], level: str, where: str) -> int:
        if level not in by_level:
            raise InputError(f"{where}: the model's table entry has no tokens for media "
                             f"resolution {level}", where)
        return by_level[level]

    def part(self, part: object, where: str, role: str) -> None:
        if not isinstance(part, dict):
            raise InputError(f"{where} must be an object", where)
        if "text" in part:
            if not isinstance(part["text"], str):
                raise InputError(f"{where}.text must be a string", where)
            self.prompt.text += text_tokens(len(part["text"].encode()))
            if role == "user" and not part.get("thought"):
                self.prompt.urls += URL_PATTERN.findall(part["text"])
        elif "inlineData" in part or "inline_data" in part:
            blob = part.get("inlineData", part.get("inline_data"))
            if not isinstance(blob, dict) or not isinstance(blob.get("data"), str):
                raise InputError(f"{where}.inlineData needs mimeType and data", where)
            mime = str(blob.get("mimeType", blob.get("mime_type", "")))
            with read_at(where):
                data = decode_base64(blob["data"], "inline data", REQUEST_BYTES_MAX)
            self.media(mime, None, data, where, _part_resolution(part, where))
        elif "fileData" in part or "file_data" in part:
            ref_doc = part.get("fileData", part.get("file_data"))
            uri = ref_doc.get("fileUri", ref_doc.get("file_uri")) if isinstance(
                ref_doc, dict) else None
            ref = self.app.registry.files.get(uri) if isinstance(uri, str) else None
            if ref is None or not isinstance(ref_doc, dict):
                raise InputError(f"{where}: File {uri!r} not found or not accessible", where)
            mime = str(ref_doc.get("mimeType", ref_doc.get("mime_type", "")))
            before = self.prompt.tokens
            self.media(mime, ref, None, where, _part_resolution(part, where))
            self.prompt.referenced += self.prompt.tokens - before
        elif "functionCall" in part or "functionResponse" in part:
            self.prompt.text += _json_tokens(part.get("functionCall",
                                                      part.get("functionResponse")))
        elif "executableCode" in part or "codeExecutionResult" in part:
            self.prompt.text += _json_tokens(part.get("executableCode",
                                                      part.get("codeExecutionResult")))
        elif "thoughtSignature" not in part:
            raise InputError(f"{where}: a part holds text, inlineData, fileData, functionCall, "
                             "functionResponse or code", where)

    def content(self, content: object, where: str, roles: tuple[str, ...]) -> None:
        if not isinstance(content, dict) or not isinstance(content.get("parts"), list):
            raise InputError(f"{where} must be a content with parts", where)
        role = content.get("role", roles[0])
        if role not in roles:
            raise InputError(f"{where}.role must be one of {', '.join(roles)}", where)
        self.prompt.text += TOKENS_PER_MESSAGE
        for j, part in enumerate(content["parts"]):
            self.part(part, f"{where}.parts[{j}]", str(role))

    def tools(self, tools: object, tool_config: object) -> None:
        if tools is None:
            tools = []
        if not isinstance(tools, list):
            raise InputError("tools must be a list", "tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise InputError(f"tools[{i}] must be an object", "tools")
            for kind, spec in tool.items():
                if kind in ("functionDeclarations", "function_declarations"):
                    if not isinstance(spec, list):
                        raise InputError("functionDeclarations must be a list", "tools")
                    for decl in spec:
                        if not isinstance(decl, dict) or not isinstance(decl.get("name"), str):
                            raise InputError("a function declaration needs a name", "tools")
                        self.prompt.functions[decl["name"]] = decl.get(
                            "parameters", decl.get("parametersJsonSchema", {}))
                        self.prompt.text += _json_tokens(decl)
                elif kind in ("googleSearch", "google_search", "googleSearchRetrieval"):
                    self.prompt.google_search = True
                elif kind in ("urlContext", "url_context"):
                    self.prompt.url_context = True
                elif kind not in ("codeExecution", "code_execution"):
                    raise InputError(f"tools[{i}].{kind} is not a tool the stub serves", "tools")
        tool_config = {} if tool_config is None else tool_config
        config = tool_config.get("functionCallingConfig", tool_config.get(
            "function_calling_config", {})) if isinstance(tool_config, dict) else None
        if not isinstance(config, dict):
            raise InputError("toolConfig.functionCallingConfig must be an object", "toolConfig")
        mode = config.get("mode", "AUTO")
        if mode not in FUNCTION_MODES:
            raise InputError(f"functionCallingConfig.mode must be one of {FUNCTION_MODES}",
                             "toolConfig")
        allowed = config.get("allowedFunctionNames", list(self.prompt.functions))
        if not isinstance(allowed, list) or any(a not in self.prompt.functions for a in allowed):
            raise InputError("allowedFunctionNames must name declared functions", "toolConfig")
        self.prompt.function_mode, self.prompt.allowed = str(mode), tuple(allowed)


def count_request(app: StubProviderApp, settings: GeminiSettings, body: dict[str, Any],
                  prices: ModelPrices) -> Prompt:
    """Count a generateContent body (InputError when it does not hold)."""
    config = body.get("generationConfig", body.get("generation_config")) or {}
    if not isinstance(config, dict):
        raise InputError("generationConfig must be an object", "generationConfig")
    assert prices.gemini is not None  # only Gemini models are counted here
    counter = Counter(app, prices.gemini, config.get("mediaResolution",
                                                     config.get("media_resolution")))
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise InputError("* GenerateContentRequest.contents: contents is not specified",
                         "contents")
    system = body.get("systemInstruction", body.get("system_instruction"))
    cached_name = body.get("cachedContent", body.get("cached_content"))
    if cached_name is not None:
        entry = settings.cached_contents.get(str(cached_name))
        if entry is None:
            raise ApiError(403, f"CachedContent not found (or permission denied): "
                           f"{cached_name}")
        if app.prices.model(entry[0]) is not prices:
            raise InputError(f"Model used by GenerateContent request ({prices.name}) and "
                             f"CachedContent ({entry[0]}) has to be the same.", "cachedContent")
        if system is not None or body.get("tools") or body.get("toolConfig"):
            raise InputError("CachedContent can not be used with GenerateContent request "
                             "setting system_instruction, tools or tool_config.",
                             "cachedContent")
        counter.prompt.cached = counter.prompt.referenced = entry[1]
    if system is not None:
        counter.content(system, "systemInstruction", ("system", "user"))
    counter.tools(body.get("tools"), body.get("toolConfig", body.get("tool_config")))
    for i, content in enumerate(contents):
        counter.content(content, f"contents[{i}]", ("user", "model", "function"))
    schema = config.get("responseSchema", config.get("responseJsonSchema"))
    if schema is not None:
        counter.prompt.text += _json_tokens(schema)
    counter.prompt.text += TOKENS_PER_REPLY
    return counter.prompt


# -- the answer --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    thoughts: int  # thinking tokens billed
    answer: int  # visible tokens billed (the text, or the function call)
    text: str
    summary: str | None  # the thought summary shown (includeThoughts), None when hidden
    call: dict[str, Any] | None  # {"name", "args"}
    finish: str
    signature: str | None


@dataclass(frozen=True, kw_only=True)
class GeminiReply(Decided):
    response_id: str
    candidates: tuple[Candidate, ...]
    prompt: Prompt
    cached: int
    tool_use_prompt: int
    queries: tuple[str, ...]
    urls: tuple[tuple[str, bool], ...]  # URL context: each URL and whether it was read
    vertex: bool


@dataclass(frozen=True)
class Thinking:
    on: bool
    budget: int  # the most it may think (the cap when no budget bounds it)
    share: Fraction
    shown: bool


def thinking_of(model: GeminiModel, config: dict[str, Any], cap: int) -> Thinking:
    doc = config.get("thinkingConfig", config.get("thinking_config")) or {}
    if not isinstance(doc, dict):
        raise invalid("thinkingConfig must be an object")
    shown = doc.get("includeThoughts", doc.get("include_thoughts", False)) is True
    budget = doc.get("thinkingBudget", doc.get("thinking_budget"))
    level = doc.get("thinkingLevel", doc.get("thinking_level"))
    if model.thinking == "none":
        if budget not in (None, 0) or level is not None:
            raise invalid("Thinking is not supported for this model.")
        return Thinking(False, 0, THINKING_SHARE, False)
    if level is not None:
        if model.thinking != "level":
            raise invalid("Thinking level is not supported for this model.")
        if budget is not None:
            raise invalid("You can only set only one of thinking budget and thinking level.")
        if not isinstance(level, str) or level.lower() not in THINKING_LEVEL_SHARES:
            raise invalid(f"thinkingLevel must be one of {sorted(THINKING_LEVEL_SHARES)}")
        return Thinking(True, cap, THINKING_LEVEL_SHARES[level.lower()], shown)
    if budget is None:
        if model.thinking == "level":
            return Thinking(True, cap, THINKING_LEVEL_SHARES[THINKING_LEVEL_DEFAULT], shown)
        if not model.thinks_by_default:
            return Thinking(False, 0, THINKING_SHARE, False)
        budget = THINKING_BUDGET_DYNAMIC
    if type(budget) is not int:
        raise invalid("thinkingBudget must be an integer")
    if budget == THINKING_BUDGET_DYNAMIC:
        return Thinking(True, model.thinking_budget_max, THINKING_SHARE, shown)
    if budget == 0 and model.thinking_budget_min == 0:
        return Thinking(False, 0, THINKING_SHARE, False)
    if not 1 <= budget <= model.thinking_budget_max:
        raise invalid(f"The thinking budget {budget} is invalid. Please choose a value between "
                      f"{model.thinking_budget_min} and {model.thinking_budget_max}.")
    # Below the range: Google does not document whether it refuses the budget or raises it to
    # the range's least; the stub raises it, the reading that bills more.
    return Thinking(True, max(budget, model.thinking_budget_min), THINKING_SHARE, shown)


def _summary(thoughts: int) -> str:
    return " ".join(THINKING_WORDS[i % len(THINKING_WORDS)]
                    for i in range(max(1, thoughts // THINKING_TOKENS_PER_SUMMARY_WORD)))


class GeminiApi(Api[GeminiReply]):
    """generateContent and streamGenerateContent of the Gemini API or of Vertex AI's Gemini
    (with `authorize`); countTokens beside them, never billed."""

    request_bytes_max = REQUEST_BYTES_MAX

    def __init__(self, app: StubProviderApp, settings: GeminiSettings,
                 authorize: Callable[[Request], None] | None = None) -> None:
        """`authorize`: Vertex AI's check of the caller (else the Gemini API's key)."""
        self.app, self.settings, self.authorize = app, settings, authorize
        self.vertex = authorize is not None
        self.name = API_VERTEX_GEMINI if self.vertex else API_GEMINI

    @staticmethod
    def target(request: Request) -> tuple[str, str]:
        model, _, action = request.path_params["target"].rpartition(":")
        return model, action

    def error(self, error: ApiError, headers: dict[str, str]) -> Response:
        return google_error(error, headers)

    def check(self, request: Request) -> set[str]:
        if self.authorize is not None:
            self.authorize(request)
        else:
            key = self.app.api_key
            given = request.headers.get("x-goog-api-key", request.query_params.get("key"))
            if key is not None and given is None:
                raise ApiError(403, "Method doesn't allow unregistered callers (callers without "
                               "established identity). Please use API Key or other form of "
                               "API consumer identity to call this API.")
            if key is not None and given != key:
                raise invalid("API key not valid. Please pass a valid API key.")
        if self.target(request)[1] == "streamGenerateContent" and request.query_params.get(
                "alt") != "sse":
            raise invalid("the stub streams only as server-sent events: add ?alt=sse")
        return set()

    def model_of(self, body: dict[str, Any], request: Request) -> str | None:
        return self.target(request)[0]

    def streams(self, body: dict[str, Any], request: Request) -> bool:
        return self.target(request)[1] == "streamGenerateContent"

    def _model(self, request: Request) -> ModelPrices:
        name = self.target(request)[0]
        prices = self.app.prices.model(name.removeprefix("models/"))
        if prices is None or prices.gemini is None:
            raise ApiError(404, f"models/{name} is not found for API version "
                           f"{request.url.path.split('/')[1]}, or is not supported "
                           "for generateContent.")
        return prices

    def _count(self, body: dict[str, Any], prices: ModelPrices) -> Prompt:
        try:
            prompt = count_request(self.app, self.settings, body, prices)
        except InputError as exc:
            raise invalid(str(exc)) from exc
        window = prices.context_window_tokens
        if window is not None and prompt.tokens > window:
            raise invalid(f"The input token count ({prompt.tokens}) exceeds the maximum number "
                          f"of tokens allowed ({window}).")
        return prompt

    async def count_tokens(self, request: Request) -> Response:
        """countTokens: the prompt tokens generateContent would bill. Free."""
        self.app.bill.requests += 1
        api = f"{self.name}.count_tokens"
        model = self.target(request)[0]
        try:
            self.check(request)
            body = await read_body(request, REQUEST_BYTES_MAX)
            prices = self._model(request)
            inner = body.get("generateContentRequest", body)
            prompt = self._count(inner if isinstance(inner, dict) else {}, prices)
        except ApiError as exc:
            self.app.log(api, model, exc.status, False, Fault())
            return self.error(exc, {})
        self.app.log(api, model, 200, False, Fault())
        answer: dict[str, Any] = {"totalTokens": prompt.tokens,
                                  "promptTokensDetails": prompt.details()}
        if prompt.cached:
            answer["cachedContentTokenCount"] = prompt.cached
        return JSONResponse(answer)

    def decide(self, body: dict[str, Any], request: Request, fault: Fault,
               betas: set[str]) -> GeminiReply:
        prices = self._model(request)
        model = prices.gemini
        assert model is not None  # checked by _model
        check_fields(body)
        prompt = self._count(body, prices)
        config = body.get("generationConfig", body.get("generation_config")) or {}
        cap = config.get("maxOutputTokens", config.get("max_output_tokens",
                                                       model.output_tokens_max))
        if type(cap) is not int or not 1 <= cap <= model.output_tokens_max:
            raise invalid(f"max_output_tokens must be between 1 and {model.output_tokens_max}")
        n = config.get("candidateCount", config.get("candidate_count", 1))
        if type(n) is not int or not 1 <= n <= CANDIDATES_MAX:
            raise invalid(f"candidateCount must be between 1 and {CANDIDATES_MAX}")
        thinking = thinking_of(model, config, cap)
        cached = prompt.cached
        if fault.cached_tokens is not None:
            # Implicit hits read the prompt's text and images, never past it (audio has a rate
            # of its own, which a hit would otherwise bill twice).
            cached = min(prompt.tokens - prompt.audio, cached + fault.cached_tokens)
        long = prices.long_context
        tier = (TIER_LONG_CONTEXT if long is not None and prompt.tokens > long.above_input_tokens
                else TIER_STANDARD)
        queries = (tuple(f"stub query {i + 1}" for i in range(
            1 if fault.web_searches is None else fault.web_searches))
            if prompt.google_search else ())
        urls = self._urls(prompt)
        tool_use = sum(tokens for _, tokens in urls)
        call = self._call(prompt, request)
        forced = header_count(request, "x-stub-output-tokens", 1)
        forced_thinking = header_count(request, "x-stub-reasoning-tokens", 0)
        outside = self.settings.thinking_outside_output_cap
        candidates = tuple(self._candidate(cap, thinking, call, forced, forced_thinking, outside)
                           for _ in range(n))
        thoughts = sum(c.thoughts for c in candidates)
        answer = sum(c.answer for c in candidates)
        usage = Usage(
            input_tokens=prompt.tokens + tool_use, cached_input_tokens=cached,
            audio_input_tokens=prompt.audio, image_input_tokens=prompt.image,
            file_input_tokens=prompt.document, output_tokens=thoughts + answer,
            reasoning_tokens=thoughts, web_search_requests=len(queries),
            referenced_input_tokens=prompt.referenced)
        # The grounding fee is the model's own (no rate in the shared table's web search
        # fields, which mean Anthropic's and OpenAI's): a grounded prompt, or each query.
        units = (len(queries) if model.grounding_per == "query" else int(bool(queries)))
        cost = (cost_micros(prices, tier, replace(usage, web_search_requests=0))
                + math.ceil(units * model.grounding_micros))
        beyond = {k: v for k, v in (("tool_use_prompt_tokens", tool_use),
                                    ("grounding_fees", units),
                                    ("cached_content_tokens", prompt.cached)) if v}
        if call is not None and call in self.app.settings.tool_calls:
            calls = list(self.app.settings.tool_calls)
            calls.remove(call)
            self.app.settings = replace(self.app.settings, tool_calls=tuple(calls))
        return GeminiReply(
            model=prices.name, usage=usage, cost_micros=cost, service_tier=tier,
            model_requested=None, beyond_body=beyond or None,
            response_id=secrets.token_urlsafe(16), candidates=candidates, prompt=prompt,
            cached=cached, tool_use_prompt=tool_use, queries=queries,
            urls=tuple((u, t > 0) for u, t in urls), vertex=self.vertex)

    def _urls(self, prompt: Prompt) -> list[tuple[str, int]]:
        """URL context: each URL in the prompt, read (its registered content's tokens) or not."""
        if not prompt.url_context:
            return []
        if len(prompt.urls) > URL_CONTEXT_URLS_MAX:
            raise invalid(f"URL context reads at most {URL_CONTEXT_URLS_MAX} URLs a request")
        read = []
        for url in prompt.urls:
            ref = self.app.registry.files.get(url)
            tokens = 0 if ref is None else text_tokens(ref.size_bytes) + ref.pages * (
                PDF_PAGE_TOKENS)
            read.append((url, tokens))
        return read

    def _call(self, prompt: Prompt, request: Request) -> dict[str, Any] | None:
        """The function call the answer makes, if any: a scripted one, the first allowed
        function when forced (mode ANY) or asked (X-Stub-Tool-Call), else none."""
        if prompt.function_mode == "NONE" or not prompt.allowed:
            return None
        scripted = next((c for c in self.app.settings.tool_calls
                         if c["name"] in prompt.allowed), None)
        if scripted is not None:
            return scripted
        if prompt.function_mode == "ANY" or request.headers.get("x-stub-tool-call") == "1":
            name = prompt.allowed[0]
            try:
                args = schema_instance(_lower_types(prompt.functions[name]) or {
                    "type": "object"})
            except InputError as exc:
                raise invalid(str(exc)) from exc
            return {"name": name, "input": args if isinstance(args, dict) else {}}
        return None

    def _candidate(self, cap: int, thinking: Thinking, call: dict[str, Any] | None,
                   forced: int | None, forced_thinking: int | None,
                   outside: bool) -> Candidate:
        """One candidate: `drawn` (or X-Stub-Output-Tokens) tokens written, thinking first;
        what the cap cuts off ends it with MAX_TOKENS (a call cut off is not made)."""
        drawn = forced if forced is not None else self.app.draw_output_tokens()
        call_tokens = 0 if call is None else _json_tokens(
            {"name": call["name"], "args": call["input"]})
        thoughts = 0
        if thinking.on:
            thoughts = (forced_thinking if forced_thinking is not None
                        else min(thinking.budget, math.floor(drawn * thinking.share)))
        if outside:  # the other reading: thinking on top of the cap, the answer alone capped
            wanted = call_tokens or max(1, drawn - thoughts)
            answer = min(wanted, cap)
        else:  # thoughts and answer together within the cap, as Google serves them
            thoughts = min(thoughts, cap)
            wanted = call_tokens or max(0, drawn - thoughts)
            answer = min(wanted, cap - thoughts)
        finish = "MAX_TOKENS" if answer < wanted else "STOP"
        text = "" if call is not None else " ".join(words(answer))
        return Candidate(
            thoughts=thoughts, answer=answer, text=text,
            summary=_summary(thoughts) if thinking.shown and thoughts else None,
            call=None if call is None or (answer < call_tokens) else {
                "name": call["name"], "args": call["input"]},
            finish=finish,
            signature=(base64.b64encode(f"stub-thought:{thoughts}:{secrets.token_hex(8)}"
                                        .encode()).decode() if thoughts else None))

    # -- the wire ------------------------------------------------------------------------------

    def _usage(self, reply: GeminiReply, *, final: bool) -> dict[str, Any]:
        prompt = reply.prompt
        doc: dict[str, Any] = {"promptTokenCount": prompt.tokens}
        thoughts = sum(c.thoughts for c in reply.candidates)
        answer = sum(c.answer for c in reply.candidates)
        if final:
            doc["candidatesTokenCount"] = answer
            if thoughts:
                doc["thoughtsTokenCount"] = thoughts
        if reply.cached:
            doc["cachedContentTokenCount"] = reply.cached
        if reply.tool_use_prompt:
            doc["toolUsePromptTokenCount"] = reply.tool_use_prompt
        doc["totalTokenCount"] = (prompt.tokens + reply.tool_use_prompt
                                  + ((answer + thoughts) if final else 0))
        doc["promptTokensDetails"] = prompt.details()
        if reply.cached:
            doc["cacheTokensDetails"] = [{"modality": "TEXT", "tokenCount": reply.cached}]
        if final:
            doc["candidatesTokensDetails"] = [{"modality": "TEXT", "tokenCount": answer}]
        if reply.vertex:
            doc["trafficType"] = "ON_DEMAND"
        return doc

    def _envelope(self, reply: GeminiReply, candidates: list[dict[str, Any]], *,
                  final: bool) -> dict[str, Any]:
        doc = {"candidates": candidates, "usageMetadata": self._usage(reply, final=final),
               "modelVersion": reply.model, "responseId": reply.response_id}
        if reply.vertex:
            doc["createTime"] = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        return doc

    def _metadata(self, reply: GeminiReply) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if reply.queries:
            doc["groundingMetadata"] = {
                "webSearchQueries": list(reply.queries),
                "groundingChunks": [{"web": {"uri": f"https://example.com/{i}",
                                             "title": f"result {i}"}}
                                    for i in range(len(reply.queries))],
                "searchEntryPoint": {"renderedContent": "<div>stub search</div>"}}
        if reply.urls:
            doc["urlContextMetadata"] = {"urlMetadata": [
                {"retrievedUrl": url, "urlRetrievalStatus": "URL_RETRIEVAL_STATUS_SUCCESS"
                 if ok else "URL_RETRIEVAL_STATUS_ERROR"} for url, ok in reply.urls]}
        return doc

    @staticmethod
    def _parts(candidate: Candidate) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if candidate.summary is not None:
            parts.append({"text": candidate.summary, "thought": True})
        if candidate.call is not None:
            parts.append({"functionCall": candidate.call})
        elif candidate.text or not parts:
            parts.append({"text": candidate.text})
        if candidate.signature is not None:
            parts[-1]["thoughtSignature"] = candidate.signature
        return parts

    def body(self, decided: GeminiReply) -> dict[str, Any]:
        candidates = [{"content": {"parts": self._parts(c), "role": "model"},
                       "finishReason": c.finish, "index": i, **self._metadata(decided)}
                      for i, c in enumerate(decided.candidates)]
        return self._envelope(decided, candidates, final=True)

    def events(self, decided: GeminiReply, fault: Fault) -> list[bytes]:
        """One chunk a thought summary and a text piece; the last of each candidate has its
        finish reason, and the very last the whole usage (earlier ones: the prompt's alone)."""
        chunks: list[bytes] = []
        last = len(decided.candidates) - 1
        for i, candidate in enumerate(decided.candidates):
            parts = self._parts(candidate)
            texts: list[dict[str, Any]] = []
            for part in parts:
                if "text" in part and not part.get("thought") and part["text"]:
                    texts += [{"text": piece} for piece in pieces(tuple(part["text"].split()))]
                    if "thoughtSignature" in part:
                        texts[0]["thoughtSignature"] = part["thoughtSignature"]
                else:
                    texts.append(part)
            for j, part in enumerate(texts):
                end = j == len(texts) - 1
                candidate_doc: dict[str, Any] = {
                    "content": {"parts": [part], "role": "model"}, "index": i}
                if end:
                    candidate_doc |= {"finishReason": candidate.finish,
                                      **self._metadata(decided)}
                chunks.append(sse(self._envelope(decided, [candidate_doc],
                                                 final=end and i == last)))
        return chunks


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.title() for word in rest)


def check_fields(body: dict[str, Any]) -> None:
    """Refuse what Google's API would not parse (an unknown field: a field the stub ignored
    could change what a real call bills), and settings that would bill output the table has no
    rate for (image or audio answers, speech)."""
    config = body.get("generationConfig", body.get("generation_config")) or {}
    for doc, known, where in ((body, REQUEST_FIELDS, ""),
                              (config, GENERATION_CONFIG_FIELDS, "generation_config")):
        for key in doc:
            if _camel(key) not in known:
                raise invalid(f'Invalid JSON payload received. Unknown name "{key}" at '
                              f"'{where}': Cannot find field.")
    modalities = config.get("responseModalities", config.get("response_modalities", ["TEXT"]))
    if modalities != ["TEXT"] or any(_camel(k) in OUTPUT_MEDIA_FIELDS for k in config):
        raise invalid("the stub answers text only: responseModalities other than TEXT, "
                      "speechConfig and imageConfig are not served")


def _lower_types(schema: Any) -> Any:
    """Google's schema (OpenAPI types in upper case: OBJECT, STRING) as JSON Schema."""
    if isinstance(schema, dict):
        return {k: (v.lower() if k == "type" and isinstance(v, str) else _lower_types(v))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_lower_types(v) for v in schema]
    return schema


# -- settings ----------------------------------------------------------------------------------


@dataclass
class GeminiSettings:
    """This module's /control settings, shared by the Gemini API and Vertex AI."""

    cached_contents: dict[str, tuple[str, int]] = field(default_factory=dict)  # (model, tokens)
    thinking_outside_output_cap: bool = False

    def controlled(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The settings `doc` gives, checked (ValueError), not yet applied."""
        given: dict[str, Any] = {}
        if "cached_contents" in doc:
            entries = doc["cached_contents"]
            if not isinstance(entries, dict) or len(entries) > CACHED_CONTENTS_MAX:
                raise ValueError(f"cached_contents is an object of at most "
                                 f"{CACHED_CONTENTS_MAX} names")
            cached = {}
            for name, entry in entries.items():
                if not isinstance(entry, dict) or set(entry) != {"model", "tokens"} or \
                        not isinstance(entry["model"], str):
                    raise ValueError(f'cached_contents[{name!r}] is {{"model", "tokens"}}')
                cached[str(name)] = (entry["model"],
                                     count(entry["tokens"], f"cached_contents[{name!r}]", 1))
            given["cached_contents"] = cached
        if "thinking_outside_output_cap" in doc:
            if type(doc["thinking_outside_output_cap"]) is not bool:
                raise ValueError("thinking_outside_output_cap is a boolean")
            given["thinking_outside_output_cap"] = doc["thinking_outside_output_cap"]
        return given

    def apply(self, given: dict[str, Any]) -> None:
        self.cached_contents = given.get("cached_contents", self.cached_contents)
        self.thinking_outside_output_cap = given.get("thinking_outside_output_cap",
                                                     self.thinking_outside_output_cap)

    def to_json(self) -> dict[str, Any]:
        return {"cached_contents": {name: {"model": m, "tokens": t}
                                    for name, (m, t) in self.cached_contents.items()},
                "thinking_outside_output_cap": self.thinking_outside_output_cap}


async def serve(app: StubProviderApp, api: GeminiApi, request: Request) -> Response:
    """A call on a Gemini route: countTokens here, the others through the app's flow."""
    action = api.target(request)[1]
    if action == "countTokens":
        return await api.count_tokens(request)
    if action not in ACTIONS:
        return google_error(ApiError(404, f"unknown method {action!r}"))
    return await app.serve(api, request)
