"""api/auth.py: the credential a request carries."""

from __future__ import annotations

import pytest

from api.auth import bearer


@pytest.mark.parametrize(("header", "credential"), [
    ("Bearer sk-1", "sk-1"),
    ("bearer sk-1", "sk-1"),
    ("BEARER  sk-1 ", "sk-1"),
    ("Basic c2s6MQ==", None),
    ("Bearer", None),
    ("", None),
    (None, None),
])
def test_bearer_reads_only_a_bearer_credential(header: str | None, credential: str | None) -> None:
    assert bearer(header) == credential
