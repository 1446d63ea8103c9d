"""The upstreams api/upstream.py's client carries as it is: calls to the upstream's base_url at
each format's path, its key (if any) in its kind's header (UpstreamKind.auth_header). The
`openai` kind (any OpenAI-compatible API, a bearer key) and `anthropic` (Messages, `x-api-key`)
name this module as their client's."""

from __future__ import annotations

from api.upstream import Upstream
from core.config import ConfigError
from core.upstreams import UpstreamDef, kind_of


def client(definition: UpstreamDef, timeout_s: float) -> Upstream:
    """api/upstream.py's client of the upstream; ConfigError when it has no base_url."""
    auth = kind_of(definition).auth_header
    if definition.base_url is None:
        raise ConfigError(f"upstream {definition.name!r}: a {definition.api} upstream needs "
                          "its base_url")
    key = definition.api_key
    return Upstream(definition.base_url,
                    (auth[0], auth[1] + key) if auth is not None and key else None, timeout_s)
