"""What every wire format carries (its body schema, its error shape), and the end user a
gateway request names in its body: the first field given; a value that is not an id names its
user by a digest."""

from __future__ import annotations

import json

from core.budgets import HASHED_USER_PREFIX, check_user
from core.formats import FORMATS
from core.formats.chat import CHAT
from core.formats.messages import MESSAGES

# Claude Code's metadata.user_id: a JSON string of its ids, longer than an id may be.
CLAUDE_CODE_USER = ('{"device_id":"' + "d" * 64 + '","account_uuid":"","session_id":"'
                    "0b6c7f3e-7a1b-4c55-9a36-1f8f3c2d9e10" + '"}')


def test_the_first_user_field_names_the_user() -> None:
    assert CHAT.end_user({"safety_identifier": "s-1", "user": "u-1"}) == "s-1"
    assert CHAT.end_user({"user": "u-1"}) == "u-1"
    assert CHAT.end_user({}) is None
    assert MESSAGES.end_user({"metadata": {"user_id": "ann@example.com"}}) == "ann@example.com"


def test_a_value_that_is_no_id_names_its_user_by_a_digest() -> None:
    named = MESSAGES.end_user({"metadata": {"user_id": CLAUDE_CODE_USER}})
    assert named is not None
    assert named.startswith(HASHED_USER_PREFIX)
    assert check_user(named) == named  # a valid id, the same for the same value
    assert MESSAGES.end_user({"metadata": {"user_id": CLAUDE_CODE_USER}}) == named
    others = {CHAT.end_user({"user": v}) for v in (5, "a" * 129, "x/team:y", "", [1], "5")}
    assert len(others) == 6  # "5" is an id; 5 is not, and hashes apart
    assert "5" in others


def test_every_format_carries_its_body_schema_and_its_error_shape() -> None:
    """What the routes and refusals read of a format, without asking which one it is."""
    error = {"type": "invalid_request_error", "code": "invalid_request", "message": "no",
             "field": "model"}
    for wire in FORMATS.values():
        schema = wire.body_schema
        assert schema["type"] == "object"
        properties = schema["properties"]
        if wire.model_in_path:  # Gemini's: its cap is a generation setting
            properties = properties["generationConfig"]["properties"]
        assert {*(() if wire.model_in_path else ("model",)), *wire.cap_fields} <= set(
            properties), wire.api
        body = wire.error_body(dict(error))
        assert json.loads(json.dumps(body))  # an answer's body: plain JSON
        event = wire.error_event(dict(error))
        assert event.endswith(b"\n\n"), wire.api
        assert b"data: " in event, wire.api
