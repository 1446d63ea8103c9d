"""`vertex`: Vertex AI's Gemini and Claude (api/upstreams/vertex.py), as a service account at a
project's region, priced by Google's table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from core.ledger import Upstream
from core.upstream_kinds.kind import UpstreamDef, UpstreamKind, UpstreamsError

# Vertex's location that serves a model from any region, at the model's base price; and the
# prefix of the name regional Vertex Claude is priced by (_dated_and_placed).
VERTEX_GLOBAL_REGION = "global"
VERTEX_REGIONAL_PREFIX = "regional."
CLAUDE_PREFIX = "claude-"
# The gateway routes it serves (WireFormat.routed_as): Claude's, and Gemini's.
MESSAGES_ROUTE, GEMINI_ROUTE = "messages", "gemini"


def _credentials_file(where: str, entry: Mapping[str, object], env: Mapping[str, str],
                      definition: UpstreamDef) -> UpstreamDef:
    del env
    value = entry.get("credentials_file")
    if not isinstance(value, str) or not Path(value).is_file():
        raise UpstreamsError(f"{where}: `credentials_file` must name a service-account JSON "
                             "file that exists")
    return replace(definition, credentials_file=value)


def _dated_and_placed(upstream: UpstreamDef, priced_model: str, sent_model: str) -> str:
    """Claude by the dated name the tables use (`@` as `-`). At a regional endpoint (any
    `region` but `global`) Claude costs 10% more than at the global one from Claude 4.5 on, and
    Google's table has only the global rates: so there it is priced as `regional.<model>`, a
    name no bundled table has, and refused (model_unpriced, nothing held) until the prices file
    names it at what the region bills. Refused rather than held at a guessed premium: which
    models carry it is Anthropic's to change, and a wrong guess under-holds silently."""
    del sent_model
    if not priced_model.startswith(CLAUDE_PREFIX):
        return priced_model
    # Vertex dates Claude with `@` (claude-sonnet-4-5@20250929); the tables, with `-`.
    dated = priced_model.replace("@", "-")
    regional = upstream.region != VERTEX_GLOBAL_REGION
    return VERTEX_REGIONAL_PREFIX + dated if regional else dated


def _publishers_route(sent_model: str) -> str:
    """Vertex serves Claude at Anthropic's publisher path (rawPredict: the Messages route) and
    every other model at Google's (generateContent: the Gemini route); a model sent on the other
    route would reach the other publisher's path, after its hold."""
    return MESSAGES_ROUTE if sent_model.startswith(CLAUDE_PREFIX) else GEMINI_ROUTE


KIND = UpstreamKind("vertex", frozenset({MESSAGES_ROUTE, GEMINI_ROUTE}), "google",
                    Upstream.GOOGLE, "vertex",
                    fields=frozenset({"project", "region", "credentials_file"}), keyed=False,
                    base_url_optional=True, read=_credentials_file,
                    price_key=_dated_and_placed, route_of=_publishers_route)
