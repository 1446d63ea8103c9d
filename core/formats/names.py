"""The wire formats' names (core/formats FORMATS holds the format of each): one member per
format, its path below its provider's base URL, in the order the gateway's routes are made.
A format's module sets its `api` to its member here. Apart from FORMATS, this is the one line a
new format adds outside its module (docs/gateway.md, "Adding a provider API").
"""

from __future__ import annotations

from enum import StrEnum


class Api(StrEnum):
    """A wire format's name: its path below its provider's base URL. core/formats FORMATS holds
    the format of each."""

    CHAT = "chat/completions"
    RESPONSES = "responses"
    # Anthropic's: its base URL (CEILING_ANTHROPIC_URL) is the SDK's, without /v1.
    MESSAGES = "v1/messages"
    # OpenAI's embeddings, on CEILING_UPSTREAM_URL as chat's and Responses' are.
    EMBEDDINGS = "embeddings"
    # Google's Gemini API, whose path names the model and, for a stream, asks for server-sent
    # events; its calls go only to named upstreams (CEILING_UPSTREAMS).
    GEMINI = "v1beta/models/{model}:generateContent"
    GEMINI_STREAM = "v1beta/models/{model}:streamGenerateContent?alt=sse"
