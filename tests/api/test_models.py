"""Request bodies as the service reads them, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.models import SettleBody
from core.errors import InvalidRequest
from core.prices import Usage


def test_a_settle_body_carries_every_count_a_usage_has() -> None:
    body = SettleBody.model_validate({
        "input_tokens": 100, "output_tokens": 20, "cached_input_tokens": 10,
        "cache_write_tokens": 5, "cache_write_1h_tokens": 4, "input_audio_tokens": 30,
        "output_audio_tokens": 7, "service_tier": "priority"})
    assert body.spec().usage == Usage(100, 20, 10, 5, 4, 30, 7, "priority")
    # Without the new fields, a settle means what it meant: the default tier, text only.
    assert SettleBody.model_validate({"input_tokens": 1, "output_tokens": 2}).spec().usage == (
        Usage(1, 2))


@pytest.mark.parametrize("doc", [
    {"input_tokens": 10, "output_tokens": 1, "input_audio_tokens": "3"},
    {"input_tokens": 10, "output_tokens": 1, "service_tier": 1},
    {"input_tokens": 10, "output_tokens": 1, "reasoning_tokens": 1},
])
def test_a_settle_body_is_strict(doc: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SettleBody.model_validate(doc)


def test_counts_that_exceed_their_whole_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        SettleBody.model_validate(
            {"input_tokens": 10, "output_tokens": 1, "output_audio_tokens": 2}).spec()
