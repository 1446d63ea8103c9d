"""api/auth.py: the credential a request carries, and what the service is asked about it."""

from __future__ import annotations

import pytest
from starlette.requests import Request

import api.auth
from api.auth import authenticated, bearer
from core.ledger import Role


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


class Recording:
    """A service that records what it was asked to authenticate."""

    def __init__(self) -> None:
        self.asked: list[tuple[object, ...]] = []

    def enforcing(self) -> Recording:
        return self

    async def authenticate(self, key: str | None, run_id: str | None, role: Role | None,
                           user: str | None) -> str:
        self.asked.append((key, run_id, role, user))
        return "caller"


def request_with(*headers: tuple[bytes, bytes]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": list(headers)})


@pytest.mark.parametrize(("headers", "key_sent", "asked"), [
    ([(b"authorization", b"Bearer sk-1"), (b"x-ceiling-run-id", b"r1"),
      (b"x-ceiling-user", b"u\xe9")], None, ("sk-1", "r1", Role.SIDECAR, "u\u00e9")),
    # The first of a repeated header, as Starlette's Headers.get reads it.
    ([(b"authorization", b"Bearer sk-1"), (b"authorization", b"Bearer sk-2")], None,
     ("sk-1", None, Role.SIDECAR, None)),
    # A key where the route's format's clients send it (read by the route: x-api-key, ...).
    ([(b"x-api-key", b"sk-3")], "sk-3", ("sk-3", None, Role.SIDECAR, None)),
    ([(b"x-api-key", b"sk-3")], None, (None, None, Role.SIDECAR, None)),
    ([(b"authorization", b"Bearer sk-1"), (b"x-api-key", b"sk-3")], "sk-3",
     ("sk-1", None, Role.SIDECAR, None)),
])
async def test_authenticated_asks_the_service_about_the_requests_key_run_and_user(
    monkeypatch: pytest.MonkeyPatch, headers: list[tuple[bytes, bytes]], key_sent: str | None,
    asked: tuple[object, ...],
) -> None:
    service = Recording()
    monkeypatch.setattr(api.auth, "runtime", lambda: service)
    assert await authenticated(request_with(*headers), Role.SIDECAR,
                               key_sent=key_sent) == (service, "caller")
    assert service.asked == [asked]
