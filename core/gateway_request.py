"""What a gateway request may cost, before anything is held: its body parsed and its fields
checked in its wire format (core/formats), its model resolved to a named upstream
(CEILING_UPSTREAMS, core/upstreams.py) and priced; and what a complete answer says it cost.
core/gateway.py holds, sends and settles from these."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from core.config import OUTPUT_TOKENS_DEFAULT
from core.errors import InvalidRequest
from core.formats import FORMATS, Plan, WireFormat
from core.formats import Api as Api  # plan() and usage_of() take a format by its name
from core.jsonbody import loads_answer, loads_object
from core.prices import Usage
from core.upstreams import Routed, UpstreamDef, Upstreams, bill_of

_COUNT_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def plan(api: Api, raw: bytes, output_tokens_default: int = OUTPUT_TOKENS_DEFAULT,
         headers: Sequence[tuple[str, str]] = (),
         fields_allowed: frozenset[str] = frozenset(),
         betas_allowed: frozenset[str] = frozenset(),
         upstreams: Upstreams | None = None, path_model: str | None = None) -> Plan:
    """Price a request body in `api`'s format; InvalidRequest before anything is reserved if it
    cannot be.

    A call that sets no output cap is sent with `output_tokens_default` (CEILING_DEFAULT_MAX_
    OUTPUT_TOKENS): without a cap there is no worst case. `headers`: the request's headers that
    its format forwards (WireFormat.forwarded_headers), which are forwarded with it.
    `fields_allowed`: the operator's fields forwarded besides the format's own
    (CEILING_GATEWAY_FIELDS_ALLOWED); `betas_allowed`: the operator's cost-neutral betas
    (CEILING_GATEWAY_BETAS_ALLOWED). `upstreams`: CEILING_UPSTREAMS, which the model is
    resolved by (routed). `path_model`: the model a format that names it in its path
    (WireFormat.model_in_path: Gemini's) was called with."""
    wire = FORMATS[api]
    body, model = _checked(wire, raw, fields_allowed, path_model)
    if upstreams is not None:
        return routed(wire, body, upstreams.resolve(model, wire.routed_as), tuple(headers),
                      output_tokens_default, betas_allowed)
    return wire.plan(body, model, tuple(headers), output_tokens_default, betas_allowed)


def routed(wire: WireFormat, body: dict[str, Any], to: Routed,
           headers: tuple[tuple[str, str], ...], output_tokens_default: int,
           betas_allowed: frozenset[str]) -> Plan:
    """A call to a named upstream, priced as the model `to` resolved it to: by the upstream's
    prices table (Plan.routed_to), as the name that table prices it by (Routed.price_model,
    which the ledger records), and sent as the name the upstream knows it by (an Azure
    deployment, a Bedrock model id). The body is the one just parsed, so the name is set in
    it; Plan.content encodes it anew in any case."""
    # A model named in the path is sent as Plan.sent_model (the upstream's client puts it there).
    if not wire.model_in_path and to.sent_model != body["model"]:
        body["model"] = to.sent_model
    return replace(wire.plan(body, to.price_model, headers, output_tokens_default,
                             betas_allowed), routed_to=to.upstream, sent_model=to.sent_model,
                   priced_model=to.priced_model, bill=bill_of(to.upstream))


def _checked(wire: WireFormat, raw: bytes, fields_allowed: frozenset[str],
             path_model: str | None = None) -> tuple[dict[str, Any], str]:
    """A request body in `wire`'s format, its top-level fields checked, and the model it
    names: in its body, or for a format that names it in its path, `path_model` (a body
    `model` is then a field the format does not know, refused by check_fields)."""
    body = loads_object(raw)
    wire.check_fields(body, fields_allowed)
    model = path_model if wire.model_in_path else body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", field="model")
    return body, model


def count_request(api: Api, raw: bytes, headers: Sequence[tuple[str, str]] = (),
                  fields_allowed: frozenset[str] = frozenset(),
                  betas_allowed: frozenset[str] = frozenset(),
                  upstreams: Upstreams | None = None,
                  path_model: str | None = None
                  ) -> tuple[bytes, UpstreamDef | None, str, str]:
    """A token counting request in `api`'s format, checked as a call's fields and headers are
    (nothing unnamed is forwarded), re-encoded for the provider; InvalidRequest if it is not.
    With `upstreams`, its model is resolved as a call's is (ModelNotRouted), named as its
    upstream knows it (Routed.sent_model), and the upstream is returned beside it; last, the
    model to count, by that name (core/upstream.py Upstream.count's `model`), and the name budgets
    count it by (Routed.priced_model; the call's own unrouted). `path_model`: as plan's."""
    wire = FORMATS[api]
    body, model = _checked(wire, raw, fields_allowed, path_model)
    wire.count_checked(body, tuple(headers), betas_allowed)
    to, priced = None, model
    if upstreams is not None:
        found = upstreams.resolve(model, wire.routed_as)
        to, model, priced = found.upstream, found.sent_model, found.priced_model
        if not wire.model_in_path:
            body["model"] = model
    return _COUNT_ENCODER.encode(body).encode(), to, model, priced


def usage_of(api: Api, usage: object, service_tier: object = None) -> Usage | None:
    """The usage an answer in `api`'s format reports (WireFormat.usage_of)."""
    return FORMATS[api].usage_of(usage, service_tier)


def body_outcome(call_plan: Plan, raw: bytes) -> tuple[Usage | None] | None:
    """A complete non-streaming answer's usage (None inside when it reports none); None if the
    answer is not a JSON object, which leaves the call's outcome unknown."""
    doc = loads_answer(raw)
    if not isinstance(doc, dict):
        return None
    return (call_plan.wire.answer_usage(doc),)
