"""Input tokens of text-only chat messages, bounded from above before the call.

Byte-level BPE tokenizers (GPT, Claude, Llama, Gemini families) never produce more tokens than
the UTF-8 bytes they encode, so bytes are a true upper bound: the reservation may be larger than
the call, never smaller, and settle charges the real count. Messages with images or audio are
bounded per model (core/content.py, core/prices/): here they are refused.

Only tests use it: the gateway bounds a call's input, media included, with core/content.py
chat_input.
"""

from __future__ import annotations

from typing import Any

from core.content import MESSAGES_MAX, TOKENS_PER_MESSAGE, TOKENS_PER_REPLY
from core.errors import InputUnbounded
from core.formats.chat import chat_input

__all__ = ["MESSAGES_MAX", "TOKENS_PER_MESSAGE", "TOKENS_PER_REPLY", "input_tokens_upper_bound"]


def input_tokens_upper_bound(messages: Any) -> int:
    """An upper bound on the prompt tokens of chat `messages` that carry text only."""
    bound = chat_input(messages)
    media = bound.media
    if media.images_low or media.images_high or media.audio_ms:
        field = media.image_field or media.audio_field
        raise InputUnbounded(
            f"{field} is media, bounded by the model's rules, not by bytes", field=field)
    return bound.text_tokens
