"""The gateway's wire formats, one module per provider API (core/formats/base.py says what one
holds): OpenAI's chat completions (chat.py) and Responses (responses.py), which share
openai.py, Anthropic's Messages (messages.py), OpenAI's embeddings (embeddings.py), and
Google's Gemini API (gemini.py), whose calls go only to named upstreams (CEILING_UPSTREAMS).

Each format is served at its own route (api/routes/gateway.py makes one per entry of FORMATS,
its OpenAPI body from WireFormat.body_schema), sent to its provider (api/upstream.py), and its
refusals answered in its shape (api/refusals.py). Adding a provider API is a module with its
WireFormat (its walker, body schema and error shape included), its name in Api (names.py) and
its entry here: docs/gateway.md, "Adding a provider API".
"""

from __future__ import annotations

from core.errors import ensure
from core.formats.base import Api, Plan, StreamTally, WireFormat
from core.formats.chat import CHAT
from core.formats.embeddings import EMBEDDINGS
from core.formats.gemini import GEMINI, GEMINI_STREAM
from core.formats.messages import MESSAGES
from core.formats.responses import RESPONSES

__all__ = ["ALLOWED_FIELDS", "FORMATS", "UNROUTED", "Api", "Plan", "StreamTally", "WireFormat"]

FORMATS: dict[Api, WireFormat] = {
    wire.api: wire for wire in (CHAT, RESPONSES, MESSAGES, EMBEDDINGS, GEMINI, GEMINI_STREAM)}
# Formats no route serves yet: none. api/routes/gateway.py serves every entry of FORMATS; a
# format added before its route waits here.
UNROUTED: dict[Api, WireFormat] = {}
ensure(list(FORMATS) + list(UNROUTED) == list(Api), "every Api has one format, in Api's order")
# Each format's allow-list (WireFormat.allowed_fields).
ALLOWED_FIELDS = {api: wire.allowed_fields for api, wire in FORMATS.items()}
