"""`openai`: OpenAI and any OpenAI-compatible API (OpenRouter, Groq, vLLM), a bearer key; its
client is api/upstream.py's (api/upstreams/keyed.py)."""

from __future__ import annotations

from core.ledger import Upstream
from core.upstream_kinds.kind import UpstreamKind

# An OpenAI-compatible upstream priced by OpenAI's table is taken to be OpenAI; priced by any
# other, it is another provider's bill, which OpenAI's report lacks.
KIND = UpstreamKind("openai", frozenset({"chat", "responses", "embeddings"}), "openai",
                    Upstream.OPENAI, "keyed", bill_own_prices_only=True)
