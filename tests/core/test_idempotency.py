"""The one maker of idempotency digests: the values earlier versions made, so that a resend that
crosses an upgrade still finds its call."""

from __future__ import annotations

import hashlib
import json

import pytest

from core.errors import InvalidRequest
from core.idempotency import checked_key, fingerprint, key_digest


def test_a_key_digest_is_the_one_reservation_ids_and_replies_were_named_by() -> None:
    # core/service.py named a caller's reservation, and core/replies.py its kept answer, so.
    assert key_digest("gw:key_1", "call-7") == hashlib.sha256(
        b"gw:key_1\ncall-7").hexdigest()[:32]
    assert key_digest("key_1", "call-7") != key_digest("key_2", "call-7")


def test_a_fingerprint_is_the_one_the_service_made() -> None:
    words = ["acme-llm", 10, None, 100, 1, None, 60_000, "run-1"]
    assert fingerprint(*words) == hashlib.sha256(
        json.dumps(words, sort_keys=True, default=str).encode()).hexdigest()[:32]
    assert fingerprint({"b": 1, "a": 2}) == fingerprint({"a": 2, "b": 1})
    assert fingerprint("a", 1) != fingerprint("a", 2)


@pytest.mark.parametrize("bad", ["", "a" * 129, "with space", "tab\t", "é"])
def test_a_key_is_printable_ascii_of_a_bounded_length(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        checked_key(bad)
    with pytest.raises(InvalidRequest):
        key_digest("key_1", bad)
