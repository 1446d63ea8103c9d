"""The upstreams api/upstream.py's client carries as it is: calls to the upstream's base_url at
each format's path, its key (if any) where the provider of its routes' formats takes it
(WireFormat.provider: Provider.auth). The `openai` kind (any OpenAI-compatible API, a bearer
key) and `anthropic` (Messages, `x-api-key`) name this module as their client's."""

from __future__ import annotations

from api.upstream import Upstream
from core.config import ConfigError
from core.formats import FORMATS
from core.upstreams import UpstreamDef, kind_of


def client(definition: UpstreamDef, timeout_s: float) -> Upstream:
    """api/upstream.py's client of the upstream; ConfigError when it has no base_url."""
    if definition.base_url is None:
        raise ConfigError(f"upstream {definition.name!r}: a {definition.api} upstream needs "
                          "its base_url")
    routes = kind_of(definition).routes
    # The kind speaks its formats' provider's API, so its key goes where that provider's does.
    provider = next(wire.provider for wire in FORMATS.values() if wire.routed_as in routes)
    key = definition.api_key
    return Upstream(definition.base_url, provider.auth(key) if key else None, timeout_s)
