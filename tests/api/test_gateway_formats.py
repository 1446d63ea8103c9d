"""What every wire format (core/formats) must be, whichever provider API it reads: the
definition a new format is checked against before its own tests."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.app import HOT_ROUTES
from api.refusals import error_event, refusal_response
from api.routing import HEADER_SCHEMAS
from core.errors import InvalidRequest
from core.formats import FORMATS, UNROUTED, Api, WireFormat
from core.formats.base import Plan
from core.gateway_request import plan

WIRES = list(FORMATS.values())
# The smallest body each format prices: the model, and its prompt.
PROMPTS: dict[Api, dict[str, Any]] = {
    Api.CHAT: {"messages": [{"role": "user", "content": "hi"}]},
    Api.RESPONSES: {"input": "hi"},
    Api.MESSAGES: {"messages": [{"role": "user", "content": "hi"}]},
    Api.EMBEDDINGS: {"input": "hi"},
    Api.GEMINI: {"contents": [{"parts": [{"text": "hi"}]}]},
    Api.GEMINI_STREAM: {"contents": [{"parts": [{"text": "hi"}]}]},
}
# A model each format prices that writes no more than its cap (Flash-Lite thinks only when
# asked); a format that names its model in its path is given it there.
MODELS: dict[Api, str] = {Api.GEMINI: "gemini-2.5-flash-lite",
                          Api.GEMINI_STREAM: "gemini-2.5-flash-lite"}


def priced_body(wire: WireFormat, body: dict[str, Any], **kwargs: Any) -> Plan:
    model = MODELS.get(wire.api, str(body.get("model")))
    if wire.model_in_path:
        body = {k: v for k, v in body.items() if k != "model"}
        return plan(wire.api, json.dumps(body).encode(), path_model=model, **kwargs)
    return plan(wire.api, json.dumps(body).encode(), **kwargs)


def at(body: dict[str, Any], path: str) -> Any:
    """The value at a dotted field path (a bound the gateway added: `generationConfig.x`)."""
    for name in path.split("."):
        body = body[name]
    return body
# The formats whose calls write output: each has an output cap and streams.
WRITING = [w for w in WIRES if w.cap_fields]


def test_every_name_has_one_format_and_one_route() -> None:
    assert list(FORMATS) + list(UNROUTED) == list(Api)
    assert all(api is wire.api for api, wire in FORMATS.items())
    routes = {r.path: r for r in HOT_ROUTES}
    assert len({w.route for w in WIRES}) == len({w.name for w in WIRES}) == len(WIRES)
    for wire in WIRES:
        assert routes[wire.route].endpoint.__name__ == wire.name


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
def test_its_fields_headers_and_usage_are_declared_consistently(wire: WireFormat) -> None:
    # A format whose model is in its path (Gemini's) has its cap in its generation settings,
    # and streams by its path.
    assert set(wire.cap_fields) <= wire.allowed_fields or wire.model_in_path
    assert ("model" in wire.allowed_fields) != wire.model_in_path
    # A format streams what it writes: one that writes nothing (embeddings) has neither.
    assert ("stream" in wire.allowed_fields) == (bool(wire.cap_fields)
                                                 and not wire.model_in_path)
    refused = {*wire.unbounded_fields, *wire.unbounded_input_fields}
    assert not refused & wire.allowed_fields
    assert wire.known_fields == wire.allowed_fields | refused
    for header in wire.headers:
        assert header in wire.header_schemas
        assert HEADER_SCHEMAS[header] == wire.header_schemas[header]
    assert len(set(wire.usage_fields)) == 4
    assert wire.provider.url_setting.startswith("CEILING_")


@pytest.mark.parametrize("wire", WRITING, ids=[w.name for w in WRITING])
def test_a_body_without_a_cap_is_sent_with_the_default_in_its_last_cap_field(
        wire: WireFormat) -> None:
    body = {"model": "gpt-4o", **PROMPTS[wire.api]}
    priced = priced_body(wire, body, output_tokens_default=77)
    assert isinstance(priced, Plan)
    assert (priced.wire, priced.api, priced.output_tokens_max) == (wire, wire.api, 77)
    [(field, value)] = priced.bounds_added
    assert (field.rsplit(".", 1)[-1], value) == (wire.cap_fields[-1], 77)
    assert at(priced.body, field) == 77
    # Gemini's clamp shares the cap with a thinking budget of at least THINKING_LEAST_MAX
    # (core/formats/gemini.py): below that, as here, thinking is off and the cap is the clamp's.
    assert at(priced.clamped(40).body, field) == 40


@pytest.mark.parametrize("wire", [w for w in WIRES if w not in WRITING])
def test_a_format_that_writes_nothing_is_sent_without_a_cap(wire: WireFormat) -> None:
    body = {"model": "text-embedding-3-small", **PROMPTS[wire.api]}
    priced = plan(wire.api, json.dumps(body).encode(), output_tokens_default=77)
    assert (priced.wire, priced.output_tokens_max, priced.bounds_added) == (wire, 0, ())
    assert (priced.body, priced.clamped(40).body, priced.stream) == (body, body, False)
    assert wire.cap_added(dict(body), 77) == ()


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
def test_its_usage_reader_reads_its_own_fields(wire: WireFormat) -> None:
    input_field, output_field, _, _ = wire.usage_fields
    usage = wire.usage_of({input_field: 12, output_field: 5})
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (12, 5)
    assert wire.usage_of(None) is None


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
def test_its_errors_keep_the_gateways_code_and_details_in_its_shape(wire: WireFormat) -> None:
    refusal = InvalidRequest("no", field="x")
    response = refusal_response(wire, refusal, {"x-ceiling-reserved-micros": "0"})
    body = json.loads(bytes(response.body))
    # api/errors.py's status, unless the format's shape names its own (Google's: 400).
    assert (response.status_code, response.headers["x-should-retry"]) == (
        wire.error_status(body, 422), "false")
    assert body == wire.error_body({"type": "invalid_request_error", "code": "invalid_request",
                                    "message": "no", "field": "x"})
    assert '"invalid_request"' in json.dumps(body)
    event = error_event(wire, refusal)
    assert event.endswith(b"\n\n")
    data = next(line for line in event.split(b"\n") if line.startswith(b"data: "))
    assert b'"invalid_request"' in data
