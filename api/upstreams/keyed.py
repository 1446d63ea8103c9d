"""The upstreams api/upstream.py's client carries as it is: calls to the upstream's base_url at
each format's path, its key (if any) where the provider of its routes' formats takes it
(WireFormat.provider: Provider.auth). The `openai` kind (any OpenAI-compatible API, a bearer
key) and `anthropic` (Messages, `x-api-key`) name this module as their client's."""

from __future__ import annotations

from api.upstream import Upstream
from core.config import ConfigError
from core.formats import FORMATS
from core.formats.base import Provider
from core.upstream_kinds.kind import UpstreamKind
from core.upstreams import UpstreamDef, kind_of


def client(definition: UpstreamDef, timeout_s: float) -> Upstream:
    """api/upstream.py's client of the upstream; ConfigError when it has no base_url."""
    if definition.base_url is None:
        raise ConfigError(f"upstream {definition.name!r}: a {definition.api} upstream needs "
                          "its base_url")
    provider = key_provider(kind_of(definition))
    key = definition.api_key
    return Upstream(definition.base_url, provider.auth(key) if key else None, timeout_s)


def key_provider(kind: UpstreamKind) -> Provider:
    """The provider whose API a keyed kind speaks, and so where its key goes: that of the formats
    its routes serve. ConfigError for a kind whose routes' formats are of two providers: one
    key has one place, and the other's calls would carry it where their provider does not
    read it (or where it is read as something else)."""
    providers = {wire.provider.upstream: wire.provider for wire in FORMATS.values()
                 if wire.routed_as in kind.routes}
    if len(providers) != 1:
        raise ConfigError(
            f"upstream kind {kind.name!r}: a keyed kind serves the formats of one provider, "
            f"not of {', '.join(sorted(str(p) for p in providers)) or 'none'} (routes "
            f"{', '.join(sorted(kind.routes))}): give each provider's routes a kind of its own")
    return next(iter(providers.values()))
