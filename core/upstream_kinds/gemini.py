"""`gemini`: Google's Gemini API with a key (api/upstreams/gemini.py), priced by Google's
table."""

from __future__ import annotations

from core.ledger import Upstream
from core.upstream_kinds.kind import UpstreamKind

KIND = UpstreamKind("gemini", frozenset({"gemini"}), "google", Upstream.GOOGLE, "gemini")
