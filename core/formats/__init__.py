"""The gateway's wire formats, one module per provider API (core/formats/base.py says what one
holds): OpenAI's chat completions (chat.py) and Responses (responses.py), which share
openai.py, and Anthropic's Messages (messages.py).

Each format is served at its own route (api/routes/gateway.py makes one per entry of FORMATS,
its OpenAPI body from WireFormat.body_schema), sent to its provider (api/upstream.py), and its
refusals answered in its shape (api/refusals.py). Adding a provider API is a module with its
WireFormat (its walker, body schema and error shape included), its name in Api (base.py) and
its entry here: docs/gateway.md, "Adding a provider API".
"""

from __future__ import annotations

from core.errors import ensure
from core.formats.base import Api, Plan, StreamTally, WireFormat
from core.formats.chat import CHAT
from core.formats.messages import MESSAGES
from core.formats.responses import RESPONSES

__all__ = ["ALLOWED_FIELDS", "FORMATS", "Api", "Plan", "StreamTally", "WireFormat"]

FORMATS: dict[Api, WireFormat] = {wire.api: wire for wire in (CHAT, RESPONSES, MESSAGES)}
ensure(list(FORMATS) == list(Api), "every Api has one format, in Api's order")
# Each format's allow-list (WireFormat.allowed_fields).
ALLOWED_FIELDS = {api: wire.allowed_fields for api, wire in FORMATS.items()}
