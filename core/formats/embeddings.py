"""OpenAI's embeddings: POST /v1/embeddings, forwarded to CEILING_UPSTREAM_URL's embeddings.

An embedding call is billed its input tokens only (https://platform.openai.com/docs/api-
reference/embeddings): its worst case is its input, each string bounded by its bytes (as every
format bounds text: core/content.py) and each token array by its length; it writes nothing, so
nothing is held for output. It is not streamed. Its usage is {prompt_tokens, total_tokens}.
"""

from __future__ import annotations

import json
from typing import Any

from core.content import InputBound, json_bytes
from core.errors import InvalidRequest
from core.formats.base import Api, Bounds, Plan, StreamTally, WireFormat, count, text_tokens
from core.formats.openai import OPENAI, openai_shape
from core.formats.schema import MODEL, STRING, Schema, any_of, array, object_of
from core.limits import TOKENS_MAX
from core.prices import Usage

# The fields OpenAI's embeddings take, none of which bills beyond the input: the output's
# size (`dimensions`) and encoding are free, and `user` names the end user.
EMBEDDINGS_FIELDS = frozenset({"model", "input", "dimensions", "encoding_format", "user"})
# OpenAI's most inputs in one request ("an array must be 2048 dimensions or less"): a longer
# list is refused before it is walked.
EMBEDDING_INPUTS_MAX = 2_048

# A token id is below this, the size of OpenAI's largest vocabulary (o200k_base's 200,019,
# rounded up; the embedding models' cl100k_base has about 100,000): a larger number is no
# token, and the provider refuses it after the gateway has held for it.
TOKEN_ID_MAX = 200_100

_TOKEN: Schema = {"type": "integer", "minimum": 0, "maximum": TOKEN_ID_MAX - 1}
EMBEDDINGS_BODY: Schema = object_of({
    "model": MODEL,
    "input": any_of(STRING, array(STRING, min_items=1), array(_TOKEN, min_items=1),
                    array(array(_TOKEN, min_items=1), min_items=1)),
    "dimensions": {"type": "integer", "minimum": 1},
    "encoding_format": {"type": "string", "enum": ["float", "base64"]},
    "user": STRING,
}, ("model", "input"), more=False)


def _is_tokens(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        type(t) is int and 0 <= t < TOKEN_ID_MAX for t in value)


def embeddings_input(given: object) -> InputBound:
    """The input bound of an embeddings `input`: a string by its bytes, a token array by its
    length, or a list of either."""
    if isinstance(given, str):
        return InputBound(json_bytes(given))
    if _is_tokens(given):
        assert isinstance(given, list)
        return InputBound(len(given))
    if isinstance(given, list) and given and all(type(t) is int for t in given):
        raise InvalidRequest(f"input's token ids must be from 0 to {TOKEN_ID_MAX - 1}",
                             field="input")
    if not isinstance(given, list) or not 0 < len(given) <= EMBEDDING_INPUTS_MAX:
        raise InvalidRequest(
            f"input must be a string, a token array, or a list of 1 to {EMBEDDING_INPUTS_MAX} "
            "of either", field="input")
    tokens = 0
    for i, item in enumerate(given):
        if isinstance(item, str):
            tokens += json_bytes(item)
        elif _is_tokens(item):
            tokens += len(item)
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            raise InvalidRequest(f"input[{i}]'s token ids must be from 0 to {TOKEN_ID_MAX - 1}",
                                 field=f"input[{i}]")
        else:
            raise InvalidRequest(f"input[{i}] must be a string or a token array",
                                 field=f"input[{i}]")
    if tokens > TOKENS_MAX:
        raise InvalidRequest("input is larger than any model's context", field="input")
    return InputBound(tokens)


class Embeddings(WireFormat):
    api = Api.EMBEDDINGS
    routed_as = "embeddings"
    route = "/v1/embeddings"
    name = "embeddings"
    body_schema = EMBEDDINGS_BODY
    provider = OPENAI
    # It writes nothing: no output cap to read or set.
    cap_fields = ()
    allowed_fields = EMBEDDINGS_FIELDS
    user_fields = (("user",),)
    usage_fields = ("prompt_tokens", "completion_tokens", "prompt_tokens_details",
                    "completion_tokens_details")

    def plan(self, body: dict[str, Any], model: str, headers: tuple[tuple[str, str], ...],
             output_tokens_default: int, betas_allowed: frozenset[str] = frozenset()) -> Plan:
        prompt = embeddings_input(body.get("input"))
        return Plan(self, model, body, False, text_tokens(body, "input", prompt), 0, 1, False)

    def cap_added(self, body: dict[str, Any], output_tokens_default: int) -> Bounds:
        return ()

    def clamped_body(self, body: dict[str, Any], output_tokens_max: int) -> dict[str, Any]:
        return dict(body)

    def usage_of(self, usage: object, service_tier: object = None) -> Usage | None:
        """{prompt_tokens, total_tokens}: all input; a total above the prompt, or completion
        tokens a compatible provider reports, are read as output, the reading that costs more
        (priced where the model has an output rate)."""
        if not isinstance(usage, dict):
            return None
        try:
            prompt = count(usage["prompt_tokens"])
            total = count(usage.get("total_tokens"))
            return Usage(prompt, max(total - prompt, count(usage.get("completion_tokens"))))
        except (KeyError, ValueError, InvalidRequest):
            return None

    def stream_event(self, tally: StreamTally, doc: dict[str, Any]) -> bool:
        # Not streamed: a stream of it is nothing the gateway asked for.
        return True

    def error_body(self, error: dict[str, Any]) -> dict[str, Any]:
        return openai_shape(error)

    def error_event(self, error: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(openai_shape(error)).encode() + b"\n\n"


EMBEDDINGS = Embeddings()
