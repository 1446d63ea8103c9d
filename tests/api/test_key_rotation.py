"""Key rotation and revocation over HTTP, across two instances of one ledger: a key's one record
decides which secrets it takes, so rotations that race leave exactly one secret taken, and a
revoke among them none."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import pytest

from infra.processes import tls_context
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client, client_for

ROTATIONS = 10
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def instances(service: ServiceProcess, redis_server: RedisServer
              ) -> Iterator[list[ServiceProcess]]:
    """The session's instance and a second one on the same Redis."""
    with ServiceProcess({"REDIS_URL": redis_server.url,
                         "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}) as other:
        yield [service, other]


async def _race(instances: list[ServiceProcess], key_id: str, *, revoke: bool
                ) -> list[httpx.Response]:
    """ROTATIONS rotations with no grace, spread over the instances and sent at once (and a
    revoke among them): the answers, the revoke's last."""
    clients = [httpx.AsyncClient(base_url=s.url, verify=tls_context(), timeout=30.0)
               for s in instances]
    try:
        calls = [clients[i % len(clients)].post(f"/v1/admin/keys/{key_id}/rotate",
                                                json={"grace_ms": 0}, headers=ADMIN)
                 for i in range(ROTATIONS)]
        if revoke:  # in the middle of them
            calls.insert(ROTATIONS // 2, clients[-1].delete(f"/v1/admin/keys/{key_id}",
                                                            headers=ADMIN))
        answers = list(await asyncio.gather(*calls))
        if revoke:
            answers.append(answers.pop(ROTATIONS // 2))
        return answers
    finally:
        for c in clients:
            await c.aclose()


def _taken(http: Client, secret: str) -> bool:
    """Whether the instance takes the secret: 200 or 401 on a read any key may make."""
    status = http.get("/v1/budgets/me", headers={"Authorization": f"Bearer {secret}"}).status_code
    assert status in (200, 401), status
    return status == 200


def _made_key(http: Client) -> tuple[str, str, str]:
    """A fresh budget and key on it: (budget id, key id, secret). The secret is not used: no
    instance trusts it from a check before the race (core/service.py KEY_TRUST_MS)."""
    tag = f"org:k{uuid.uuid4().hex[:10]}"
    http.budget(tag, 1_000_000)
    made = http.admin("POST", "/v1/admin/keys", json={"budget_id": tag})
    assert made.status_code == 201, made.text
    return tag, made.json()["key_id"], made.json()["api_key"]


def test_racing_rotations_without_grace_leave_exactly_one_secret(
        instances: list[ServiceProcess]) -> None:
    with client_for(instances[0]) as first, client_for(instances[1]) as second:
        tag, key_id, original = _made_key(first)
        answers = asyncio.run(_race(instances, key_id, revoke=False))
        assert [r.status_code for r in answers] == [200] * ROTATIONS, [r.text for r in answers]
        secrets = [original, *(r.json()["api_key"] for r in answers)]
        assert len(set(secrets)) == ROTATIONS + 1
        taken = [[s for s in secrets if _taken(http, s)] for http in (first, second)]
        assert taken[0] == taken[1]
        assert len(taken[0]) == 1
        assert taken[0][0] != original
        listed = first.admin("GET", "/v1/admin/keys", params={"budget_id": tag}).json()
        assert [(k["key_id"], k["previous_secret_valid_ms"]) for k in listed["items"]] == [
            (key_id, None)]


def test_a_revoke_racing_rotations_leaves_no_secret(instances: list[ServiceProcess]) -> None:
    with client_for(instances[0]) as first, client_for(instances[1]) as second:
        tag, key_id, original = _made_key(first)
        *rotations, revoke = asyncio.run(_race(instances, key_id, revoke=True))
        assert revoke.status_code == 200, revoke.text
        # Each rotation ran before the revoke (a secret) or after it (404: no such key).
        assert {r.status_code for r in rotations} <= {200, 404}
        secrets = [original, *(r.json()["api_key"] for r in rotations if r.status_code == 200)]
        for http in (first, second):
            assert [s for s in secrets if _taken(http, s)] == []
        assert first.admin("GET", "/v1/admin/keys", params={"budget_id": tag}).json()[
            "items"] == []
        assert first.admin("POST", f"/v1/admin/keys/{key_id}/rotate",
                           json={"grace_ms": 0}).status_code == 404
