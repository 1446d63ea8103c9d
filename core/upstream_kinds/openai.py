"""`openai`: OpenAI and any OpenAI-compatible API (OpenRouter, Groq, vLLM), a bearer key; its
client is api/upstream.py's (api/upstreams/keyed.py)."""

from __future__ import annotations

from core.ledger import Upstream
from core.upstream_kinds.kind import UpstreamKind

# An OpenAI-compatible upstream is OpenAI's bill only at OpenAI's own API, priced by OpenAI's
# table; elsewhere, or priced by any other, it is another provider's, which OpenAI's report lacks.
OPENAI_API_HOST = "api.openai.com"
KIND = UpstreamKind("openai", frozenset({"chat", "responses", "embeddings"}), "openai",
                    Upstream.OPENAI, "keyed", bill_own_prices_only=True,
                    bill_host=OPENAI_API_HOST)
