"""`anthropic`: Anthropic's Messages API, the key in `x-api-key`; its client is api/upstream.py's
(api/upstreams/keyed.py)."""

from __future__ import annotations

from core.ledger import Upstream
from core.upstream_kinds.kind import UpstreamKind

# Anthropic's bill only at Anthropic's own API (a proxy speaking Messages is another's).
ANTHROPIC_API_HOST = "api.anthropic.com"
KIND = UpstreamKind("anthropic", frozenset({"messages"}), "anthropic", Upstream.ANTHROPIC,
                    "keyed", bill_host=ANTHROPIC_API_HOST)
