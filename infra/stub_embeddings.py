"""OpenAI's embeddings on the stub provider: POST /v1/embeddings (and Azure's, infra.stub_azure).

The wire format is OpenAI's (https://developers.openai.com/api/reference/resources/embeddings):
`input` a string, a list of strings, a token array or a list of token arrays; `dimensions`
(only on a model whose table entry says its vectors may be shortened: the -3 models);
`encoding_format` float or base64 (little-endian float32, what the SDKs ask by default); `user`.
Refused, 400 and unbilled: an empty input or string, more than INPUTS_MAX inputs, an input above
the model's `input_tokens_max`, more than REQUEST_TOKENS_MAX tokens in all, any other field. A
model without an `embedding` entry in the table is not served here (nor is an embedding model on
the chat and Responses routes).

Billing: input tokens only, at the model's input rate, counted by the stub's own rule
(infra.stub_tokens: a string's UTF-8 bytes over four, rounded up, each on its own, with no
message framing; a token array is its length). `usage` reports {prompt_tokens, total_tokens},
both the input. Never streamed. The vectors are the stub's: each the same unit vector, which a
client decodes and nothing bills.
"""

from __future__ import annotations

import base64
import math
import secrets
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from infra.stub_bill import Usage
from infra.stub_faults import Api, ApiError, Decided, Fault
from infra.stub_openai import checked_bearer, error_response
from infra.stub_prices import TIER_STANDARD, EmbeddingModel, cost_micros
from infra.stub_tokens import text_tokens

if TYPE_CHECKING:
    from infra.stub_provider import StubProviderApp

API_NAME = "embeddings"
# OpenAI's limits (https://developers.openai.com/api/reference/resources/embeddings/methods/
# create): at most 2,048 inputs and 300,000 tokens a request; each input within the model's
# own limit (the table's input_tokens_max).
INPUTS_MAX = 2_048
REQUEST_TOKENS_MAX = 300_000
FIELDS = frozenset({"model", "input", "dimensions", "encoding_format", "user"})
ENCODING_FORMATS = ("float", "base64")
# A token id is below this, the size of OpenAI's largest vocabulary (o200k_base's, rounded up;
# the embedding models' cl100k_base has about 100,000): a larger number is not a token.
TOKEN_ID_MAX = 200_100


@dataclass(frozen=True, kw_only=True)
class Embedded(Decided):
    """An embeddings call decided: how many vectors, of what length, in which encoding."""

    inputs: int
    dimensions: int
    encoding: str


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def input_tokens(given: object) -> list[int]:
    """The tokens of each input, by the stub's text rule or the token arrays' lengths."""
    if isinstance(given, str):
        given = [given]
    elif isinstance(given, list) and given and all(type(t) is int for t in given):
        given = [given]  # one token array
    if not isinstance(given, list) or not given:
        raise invalid("'input' must be a non-empty string, list of strings, token array or "
                      "list of token arrays", "input")
    if len(given) > INPUTS_MAX:
        raise invalid(f"'input' holds at most {INPUTS_MAX} inputs", "input")
    counts = []
    for i, one in enumerate(given):
        if isinstance(one, str) and one:
            counts.append(text_tokens(len(one.encode())))
        elif (isinstance(one, list) and one
              and all(type(t) is int and 0 <= t < TOKEN_ID_MAX for t in one)):
            counts.append(len(one))
        else:
            raise invalid(f"'input[{i}]' must be a non-empty string or token array", "input")
    return counts


class EmbeddingsApi(Api[Embedded]):
    """POST /v1/embeddings, on the app's shared bill, prices and faults."""

    name = API_NAME

    def __init__(self, app: StubProviderApp) -> None:
        self.app = app

    def check(self, request: Request) -> set[str]:
        return checked_bearer(self.app.api_key, request)

    def error(self, error: ApiError, headers: dict[str, str]) -> Response:
        return error_response(error, headers)

    def model(self, name: object) -> EmbeddingModel:
        """The embedding model of that name (404 when the table has none; 400 when it is not
        an embedding model)."""
        if not isinstance(name, str):
            raise invalid("model is required", "model")
        prices = self.app.prices.model(name)
        if prices is None:
            raise ApiError(404, f"the model {name!r} does not exist", "model_not_found",
                           param="model")
        if prices.embedding is None:
            raise invalid(f"{name} does not support embeddings", "model")
        return prices.embedding

    def decide(self, body: dict[str, Any], request: Request, fault: Fault,
               betas: set[str]) -> Embedded:
        unknown = set(body) - FIELDS
        if unknown:
            raise invalid(f"Unrecognized request argument supplied: {sorted(unknown)[0]}",
                          sorted(unknown)[0])
        model = self.model(body.get("model"))
        counts = input_tokens(body.get("input"))
        too_long = next((i for i, n in enumerate(counts) if n > model.input_tokens_max), None)
        if too_long is not None:
            raise invalid(f"'input[{too_long}]' is {counts[too_long]} tokens, more than this "
                          f"model's maximum input length of {model.input_tokens_max} tokens",
                          "input")
        tokens = sum(counts)
        if tokens > REQUEST_TOKENS_MAX:
            raise invalid(f"the request holds {tokens} tokens; at most {REQUEST_TOKENS_MAX} "
                          "tokens a request", "input")
        dimensions = body.get("dimensions")
        if dimensions is not None and not model.dimensions_settable:
            raise invalid("This model does not support specifying dimensions.", "dimensions")
        if dimensions is not None and (type(dimensions) is not int
                                       or not 1 <= dimensions <= model.dimensions):
            raise invalid(f"dimensions must be an integer from 1 to {model.dimensions}",
                          "dimensions")
        encoding = body.get("encoding_format", "float")
        if encoding not in ENCODING_FORMATS:
            raise invalid(f"encoding_format is one of {', '.join(ENCODING_FORMATS)}",
                          "encoding_format")
        if not isinstance(body.get("user", ""), str):
            raise invalid("user must be a string", "user")
        name = str(body["model"])
        prices = self.app.prices.model(name)
        assert prices is not None  # found by self.model
        usage = Usage(input_tokens=tokens)
        return Embedded(model=prices.name, usage=usage,
                        cost_micros=cost_micros(prices, TIER_STANDARD, usage),
                        service_tier=TIER_STANDARD,
                        model_requested=None if name == prices.name else name,
                        inputs=len(counts), dimensions=dimensions or model.dimensions,
                        encoding=str(encoding))

    def body(self, decided: Embedded) -> dict[str, Any]:
        vector: Any = [round(1 / math.sqrt(decided.dimensions), 8)] * decided.dimensions
        if decided.encoding == "base64":
            vector = base64.b64encode(struct.pack(f"<{decided.dimensions}f", *vector)).decode()
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": vector}
                     for i in range(decided.inputs)],
            "model": decided.model,
            "usage": {"prompt_tokens": decided.usage.input_tokens,
                      "total_tokens": decided.usage.input_tokens},
        }

    def headers(self) -> dict[str, str]:
        return {"x-request-id": "req_" + secrets.token_hex(12)}
