"""Input tokens of a request, bounded from above before the call.

Byte-level BPE tokenizers (GPT, Claude, Llama, Gemini families) never produce more tokens than
the UTF-8 bytes they encode, so bytes are a true upper bound: the reservation may be larger than
the call, never smaller, and settle charges the real count.
"""

from __future__ import annotations

import json
from typing import Any

from core.errors import InvalidRequest
from core.limits import TOKENS_MAX

# OpenAI's chat format adds a few tokens per message (role, separators) and per reply (priming).
TOKENS_PER_MESSAGE = 4
TOKENS_PER_REPLY = 3
# A request with more messages than this is refused rather than walked.
MESSAGES_MAX = 10_000


def input_tokens_upper_bound(messages: Any) -> int:
    """An upper bound on the prompt tokens of chat `messages` (a list of message objects)."""
    if not isinstance(messages, list) or not messages or len(messages) > MESSAGES_MAX:
        raise InvalidRequest(
            f"messages must be a list of 1 to {MESSAGES_MAX} messages", field="messages"
        )
    tokens = TOKENS_PER_REPLY
    for message in messages:
        if not isinstance(message, dict):
            raise InvalidRequest("each message must be an object", field="messages")
        # Every string and structure the provider may tokenize, counted by its JSON bytes.
        tokens += TOKENS_PER_MESSAGE + len(json.dumps(message, ensure_ascii=False).encode())
    if tokens > TOKENS_MAX:
        raise InvalidRequest("messages are larger than any model's context", field="messages")
    return tokens
