"""Nobody in where they do not belong: crafted paths and run ids, closed admin, quiet logs."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client, client_for


def org() -> str:
    return f"org:t{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize("run_id", ["../team:b", "x/team:b", "a:b", "{x}", "é".encode(), "",
                                    "a" * 65])
def test_a_run_id_cannot_reach_another_budget(http: Client, run_id: str | bytes) -> None:
    tag = org()
    http.budget(tag, 1_000)
    key = http.sidecar_key(f"{tag}/team:a", run_ceiling_micros=10)
    headers = [(k.encode(), v.encode()) for k, v in key.items()]
    headers.append((b"X-Ceiling-Run-Id", run_id if isinstance(run_id, bytes) else run_id.encode()))
    r = http.post("/v1/reservations", headers=headers, json={"amount_micros": 1})
    assert r.status_code == 422, r.text
    books = http.admin("GET", f"/v1/admin/budgets/{tag}").json()["periods"][0]
    assert books["reserved_micros"] == 0


def test_a_body_cannot_name_another_budget(http: Client) -> None:
    tag, victim = org(), org()
    http.budget(tag, 1_000)
    http.budget(victim, 1_000)
    key = http.sidecar_key(tag)
    for body in ({"amount_micros": 1, "budget_id": victim},
                 {"amount_micros": 1, "budget": victim}):
        assert http.post("/v1/reservations", headers=key, json=body).status_code == 422
    victim_books = http.admin("GET", f"/v1/admin/budgets/{victim}").json()["periods"][0]
    assert victim_books["reserved_micros"] == 0


def test_a_guessed_reservation_id_from_another_org_is_not_found(http: Client) -> None:
    tag, other = org(), org()
    http.budget(tag, 1_000)
    http.budget(other, 1_000)
    mine = http.sidecar_key(tag)
    rid = http.post("/v1/reservations", headers=mine, json={"amount_micros": 5}).json()[
        "reservation_id"]
    for crafted in (rid, f"{rid}/../x", "%7B" + rid + "%7D"):
        r = http.post(f"/v1/reservations/{crafted}/release", headers=http.sidecar_key(other))
        assert r.status_code == 404


def test_admin_routes_are_closed_without_a_configured_token(redis_server: RedisServer) -> None:
    with ServiceProcess({"REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ""}) as s, \
            client_for(s) as http:
        for headers in ({}, {"Authorization": "Bearer anything"},
                        {"Authorization": f"Bearer {ADMIN_TOKEN}"}):
            r = http.get("/v1/admin/budgets/org:x", headers=headers)
            assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden")


def test_tokens_and_keys_never_reach_the_logs(redis_server: RedisServer, tmp_path: Path) -> None:
    log = tmp_path / "service.log"
    env = {"REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}
    with ServiceProcess(env, log_path=str(log)) as s, client_for(s) as http:
        tag = org()
        http.budget(tag, 10)
        key = http.sidecar_key(tag)
        secret = key["Authorization"].removeprefix("Bearer ")
        http.post("/v1/reservations", headers=key, json={"amount_micros": 10})
        http.post("/v1/reservations", headers=key, json={"amount_micros": 10})
        http.post("/v1/reservations", headers={"Authorization": f"Bearer {secret}x"},
                  json={"amount_micros": "bad"})
        http.get("/v1/admin/budgets/org:none", headers={"Authorization": "Bearer wrong-admin"})
    text = log.read_text()
    for leaked in (secret, ADMIN_TOKEN, "wrong-admin"):
        assert leaked not in text
