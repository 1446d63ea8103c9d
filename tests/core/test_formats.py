"""The end user a gateway request names in its body: the first field given, each one checked."""

from __future__ import annotations

import pytest

from core.errors import InvalidRequest
from core.formats.chat import CHAT
from core.formats.messages import MESSAGES


def test_the_first_user_field_names_the_user_and_every_one_given_is_checked() -> None:
    assert CHAT.end_user({"safety_identifier": "s-1", "user": "u-1"}) == "s-1"
    assert CHAT.end_user({"user": "u-1"}) == "u-1"
    assert CHAT.end_user({}) is None
    # Forwarded as it is, so refused as it is: a bad `user` beside a good safety_identifier.
    with pytest.raises(InvalidRequest) as bad:
        CHAT.end_user({"safety_identifier": "s-1", "user": "bad user/with|pipes"})
    assert bad.value.details["field"] == "user"
    assert MESSAGES.end_user({"metadata": {"user_id": "ann@example.com"}}) == "ann@example.com"
    with pytest.raises(InvalidRequest) as bad:
        MESSAGES.end_user({"metadata": {"user_id": 5}})
    assert bad.value.details["field"] == "metadata.user_id"
