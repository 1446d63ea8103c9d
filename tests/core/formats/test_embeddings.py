"""OpenAI's embeddings as a wire format: input held by its bytes (or its token arrays' lengths),
nothing held for output, usage read from {prompt_tokens, total_tokens}. Rates by hand
(genai-prices, provider openai): text-embedding-3-small 0.02 and -large 0.13 micro-dollars a
token, no output rate."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest

from core.content import json_bytes
from core.errors import FieldUnsupported, InvalidRequest
from core.formats import FORMATS, UNROUTED, Api
from core.formats.embeddings import EMBEDDING_INPUTS_MAX, EMBEDDINGS, TOKEN_ID_MAX
from core.prices import PriceTable, Usage

TABLE = PriceTable()
SMALL, LARGE = "text-embedding-3-small", "text-embedding-3-large"


def plan(given: dict[str, Any]) -> Any:
    return EMBEDDINGS.plan(given, given["model"], (), 4_096)


def held(call: Any) -> int:
    spec = call.spec()
    return TABLE.worst_case_micros(spec.model, spec.input_tokens, spec.output_tokens_max,
                                   spec.choices, media=spec.media, provider=spec.provider)


def framing(given: dict[str, Any]) -> int:
    return json_bytes({k: v for k, v in given.items() if k != "input"})


@pytest.mark.parametrize(("given_input", "tokens"), [
    ("héllo", len("\"héllo\"".encode())),
    (["a b", "c"], len(b'"a b"') + len(b'"c"')),
    ([1, 2, 3], 3),
    ([[1, 2], [3]], 3),
    (["ab", [7, 8, 9]], len(b'"ab"') + 3),
])
def test_input_is_held_by_its_bytes_or_its_tokens_and_no_output(given_input: Any,
                                                               tokens: int) -> None:
    given = {"model": LARGE, "input": given_input, "dimensions": 256,
             "encoding_format": "base64", "user": "u-1"}
    call = plan(given)
    assert call.text_tokens_max == tokens + framing(given)
    assert call.output_tokens_max == 0
    assert call.choices == 1
    assert not call.stream
    assert call.bounds_added == ()
    assert call.spec().provider == "openai"
    assert held(call) == math.ceil(Fraction(call.text_tokens_max) * Fraction("0.13"))
    assert EMBEDDINGS.end_user(given) == "u-1"


@pytest.mark.parametrize(("given_input", "field"), [
    ([], "input"),
    (None, "input"),
    ([[]], "input[0]"),
    ([[-1]], "input[0]"),
    ([1.5], "input[0]"),
    ([1, 2, TOKEN_ID_MAX], "input"),
    ([[TOKEN_ID_MAX]], "input[0]"),
    ([[7, 10**30]], "input[0]"),
    (["a", {"text": "b"}], "input[1]"),
    (["a"] * (EMBEDDING_INPUTS_MAX + 1), "input"),
])
def test_input_of_another_shape_is_refused_by_name(given_input: Any, field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        plan({"model": SMALL, "input": given_input})
    assert refused.value.details["field"] == field


def test_fields_it_does_not_know_are_refused() -> None:
    for field in ("stream", "max_tokens", "input_type"):
        with pytest.raises(FieldUnsupported) as refused:
            EMBEDDINGS.check_fields({"model": SMALL, "input": "x", field: 1}, frozenset())
        assert refused.value.details["field"] == field


def test_its_usage_is_all_input() -> None:
    usage = EMBEDDINGS.usage_of({"prompt_tokens": 8, "total_tokens": 8})
    assert usage == Usage(8, 0)
    assert TABLE.cost_micros(SMALL, usage, "openai") == math.ceil(8 * Fraction("0.02"))
    assert EMBEDDINGS.answer_usage({"object": "list", "data": [], "model": SMALL,
                                    "usage": {"prompt_tokens": 5, "total_tokens": 5}}) == (
        Usage(5, 0))
    # A total above the prompt is read as output, the reading that costs more.
    assert EMBEDDINGS.usage_of({"prompt_tokens": 5, "total_tokens": 9}) == Usage(5, 4)
    # So are completion tokens a compatible provider reports, whichever is more.
    assert EMBEDDINGS.usage_of({"prompt_tokens": 5, "total_tokens": 5,
                                "completion_tokens": 3}) == Usage(5, 3)
    assert EMBEDDINGS.usage_of({"prompt_tokens": 5, "total_tokens": 12,
                                "completion_tokens": 3}) == Usage(5, 7)
    for bad in (None, {}, {"prompt_tokens": -1}, {"prompt_tokens": "5"}):
        assert EMBEDDINGS.usage_of(bad) is None


def test_its_errors_are_openais_and_it_is_routed() -> None:
    shaped = EMBEDDINGS.error_body({"type": "invalid_request_error", "code": "invalid_request",
                                    "message": "no", "field": "input"})
    assert shaped == {"error": {"message": "no", "type": "invalid_request_error",
                                "param": "input", "code": "invalid_request"}}
    assert EMBEDDINGS.error_event({"type": "t", "code": "c", "message": "m"}).startswith(
        b"data: ")
    assert FORMATS[Api.EMBEDDINGS] is EMBEDDINGS
    assert Api.EMBEDDINGS not in UNROUTED
    assert EMBEDDINGS.route == "/v1/embeddings"
    assert EMBEDDINGS.clamped_body({"model": SMALL, "input": "x"}, 300) == {
        "model": SMALL, "input": "x"}


def test_no_output_is_held_only_for_a_model_that_writes_nothing() -> None:
    assert TABLE.worst_case_micros(SMALL, 1_000, 0, provider="openai") == 20
    with pytest.raises(InvalidRequest) as refused:
        TABLE.worst_case_micros("gpt-4o", 1_000, 0, provider="openai")
    assert refused.value.details["field"] == "max_output_tokens"
