"""Operating it over HTTP and the command line (issue 17): lists, delete, rotation, the audit
stream, the outage policy, and recovery from a wiped ledger with export, restore and adopt."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from core.service import KEY_TRUST_MS, operator_fingerprint
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client
from tests.api.test_cli import ceiling

# An instance that found its ledger reset looks for an adoption about once a second.
ADOPT_WAIT_S_MAX = 10.0


def _error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def test_lists_page_and_show_no_secrets(http: Client) -> None:
    tag = f"org:l{uuid.uuid4().hex[:10]}"
    for i in range(3):
        http.budget(f"{tag}/team:t{i}", 100)
    http.budget(f"{tag}x", 100)  # shares the prefix's first characters, not its path
    seen, cursor = [], None
    while True:
        params = {"prefix": f"{tag}/", "limit": 2, **({"cursor": cursor} if cursor else {})}
        page = http.admin("GET", "/v1/admin/budgets", params=params).json()
        seen += [b["budget_id"] for b in page["items"]]
        if page["next_cursor"] is None:
            break
        cursor = page["next_cursor"]
    assert seen == [f"{tag}/team:t{i}" for i in range(3)]
    made = http.admin("POST", "/v1/admin/keys", json={"budget_id": f"{tag}/team:t0",
                                                       "roles": ["sidecar"]}).json()
    listed = http.admin("GET", "/v1/admin/keys", params={"budget_id": f"{tag}/team:t0"})
    assert [k["key_id"] for k in listed.json()["items"]] == [made["key_id"]]
    assert made["api_key"] not in listed.text
    assert set(listed.json()["items"][0]) >= {"roles", "created_ms", "last_used_ms"}
    for params in ({"cursor": "%%%"}, {"limit": 0}, {"limit": 100_000}, {"prefix": "{x}"}):
        assert _error(http.admin("GET", "/v1/admin/budgets", params=params)) == (
            422, "invalid_request"), params
    assert http.get("/v1/admin/budgets").status_code == 401
    assert http.get("/v1/admin/audit").status_code == 401


def test_rotation_delete_and_the_audit_stream(http: Client) -> None:
    tag = f"org:d{uuid.uuid4().hex[:10]}"
    http.budget(tag, 1_000_000)
    made = http.admin("POST", "/v1/admin/keys", json={"budget_id": tag,
                                                       "roles": ["sidecar"]}).json()
    old = {"Authorization": f"Bearer {made['api_key']}"}
    rotated = http.admin("POST", f"/v1/admin/keys/{made['key_id']}/rotate",
                         json={"grace_ms": 60_000})
    assert rotated.status_code == 200, rotated.text
    new = {"Authorization": f"Bearer {rotated.json()['api_key']}"}
    for auth in (old, new):  # both within the grace period
        assert http.post("/v1/reservations", headers=auth,
                         json={"amount_micros": 5}).status_code == 201
    assert _error(http.admin("POST", "/v1/admin/keys/key_0000/rotate")) == (
        404, "budget_not_found")
    assert _error(http.admin("POST", "/v1/admin/keys/nope/rotate")) == (422, "invalid_request")
    assert _error(http.admin("POST", f"/v1/admin/keys/{made['key_id']}/rotate",
                             json={"grace_ms": -1})) == (422, "invalid_request")
    # Two open reservations hold money in it: refused, nothing changed.
    refused = http.admin("DELETE", f"/v1/admin/budgets/{tag}")
    assert _error(refused) == (409, "budget_in_use")
    assert refused.json()["error"]["open_reservations"] == 2
    assert http.admin("GET", f"/v1/admin/budgets/{tag}").status_code == 200
    assert f">{tag}<" in http.admin("GET", "/dashboard").text
    forced = http.admin("DELETE", f"/v1/admin/budgets/{tag}", params={"force": "1"}).json()
    assert (forced["reservations_charged_as_unknown"], forced["charged_micros"]) == (2, 10)
    assert forced["keys_revoked"] == [made["key_id"]]
    assert _error(http.admin("DELETE", f"/v1/admin/budgets/{tag}")) == (404, "budget_not_found")
    page = http.admin("GET", "/dashboard")
    assert page.status_code == 200
    assert tag not in page.text  # the page lists what the ledger has
    time.sleep(KEY_TRUST_MS / 1000)
    for auth in (old, new):  # a deleted budget's keys, old secret and new
        assert _error(http.post("/v1/reservations", headers=auth,
                                json={"amount_micros": 5})) == (401, "unauthorized")
    entries = http.admin("GET", "/v1/admin/audit", params={"limit": 50}).json()["items"]
    # The ledger is shared with other tests (the CLI's changes are by `cli:<user>`): this
    # test's own entries only.
    mine = [e for e in entries if tag in json.dumps(e) or e["target"] == made["key_id"]]
    assert [(e["what"], e["target"]) for e in mine[:4]] == [
        ("budget.delete", tag), ("key.rotate", made["key_id"]), ("key.create", made["key_id"]),
        ("budget.put", tag)]
    assert {e["who"] for e in mine} == {operator_fingerprint(ADMIN_TOKEN)}
    assert all(e["at_ms"] > 0 for e in mine)


def test_the_outage_policy_is_stored_and_open_budgets_show_in_health(http: Client) -> None:
    tag = f"org:o{uuid.uuid4().hex[:10]}"
    r = http.admin("PUT", f"/v1/admin/budgets/{tag}", json={
        "limits": [{"period": "total", "ceiling_micros": 1000}], "outage_policy": "open"})
    assert r.status_code == 200, r.text
    assert (r.json()["outage_policy"], r.json()["outage_allowance_micros"]) == ("open", 0)
    bad = http.admin("PUT", f"/v1/admin/budgets/{tag}", json={
        "limits": [{"period": "total", "ceiling_micros": 1000}], "outage_policy": "closed",
        "outage_allowance_micros": 5})
    assert _error(bad) == (422, "invalid_request")
    auth = http.sidecar_key(tag)
    assert http.post("/v1/reservations", headers=auth, json={"amount_micros": 5}).status_code == 201
    assert tag in http.admin("GET", "/health").json()["outage_open_budgets"]
    assert http.admin("GET", "/health").json()["outage_open_budgets_count"] >= 1
    public = http.get("/health").json()  # health answers anyone: status and reasons only
    assert set(public) == {"status", "reasons"}


@pytest.mark.slow  # a Redis, a service and five `ceiling` processes of its own
def test_recovery_from_a_wipe_is_one_command_and_a_confirmation(tmp_path: Path) -> None:
    with RedisServer(durable=False) as server, ServiceProcess(
            {"REDIS_URL": server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
             "CEILING_ACCEPT_NOT_DURABLE": "1"}) as service:
        env = {"CEILING_ADMIN_TOKEN": ADMIN_TOKEN}
        tag = "org:w"
        with Client(base_url=service.url, timeout=10.0) as client:
            client.budget(tag, 1000)
            auth = client.sidecar_key(tag)
            key = {"api_key": auth["Authorization"].removeprefix("Bearer ")}

            def reserve() -> httpx.Response:
                return client.post("/v1/reservations", headers=auth, json={"amount_micros": 300})

            first = reserve().json()
            client.post(f"/v1/reservations/{first['reservation_id']}/settle", headers=auth,
                        json={"actual_micros": 250}).raise_for_status()
            assert reserve().status_code == 201  # left open: comes back charged as unknown
            export = tmp_path / "ledger.json"
            done = ceiling(server, "ledger", "export", str(export), env=env)
            assert done.returncode == 0, done.stderr
            assert oct(os.stat(export).st_mode & 0o777) == "0o600"
            assert key["api_key"] not in export.read_text()

            redis.Redis.from_url(server.url).flushall()
            assert reserve().json()["error"]["reason"] == "ledger_reset"

            tampered = tmp_path / "tampered.json"
            doc = json.loads(export.read_text())
            doc["body"]["organisations"][0]["counters"][0]["committed_micros"] = 0
            tampered.write_text(json.dumps(doc))
            bad = ceiling(server, "ledger", "restore", str(tampered), env=env)
            assert bad.returncode == 1
            assert "checksum" in bad.stderr
            assert redis.Redis.from_url(server.url).exists("{sc:ledger}:orgs") == 0

            bill = tmp_path / "bill.json"
            bill.write_text(json.dumps({"format": "spend-ceiling/bill/1", "entries": [
                {"budget_id": tag, "billed_micros": 600}]}))
            restored = ceiling(server, "ledger", "restore", str(export), "--book-from-bill",
                               str(bill), env=env)
            assert restored.returncode == 0, restored.stderr
            assert reserve().json()["error"]["reason"] == "ledger_reset"  # not yet confirmed
            again = ceiling(server, "ledger", "restore", str(export), env=env)
            assert again.returncode == 1
            assert "ledger_not_empty" in again.stderr
            assert ceiling(server, "ledger", "adopt", env=env).returncode == 0
            deadline = time.monotonic() + ADOPT_WAIT_S_MAX
            while (answer := reserve()).status_code != 201:
                assert time.monotonic() < deadline, answer.text
                time.sleep(0.2)
            # 250 settled + 300 charged as unknown + the bill's remaining 50; nothing refilled.
            legs = answer.json()["budgets"]
            assert (legs[0]["committed_micros"], legs[0]["reserved_micros"]) == (600, 300)
            assert client.get("/health").json()["reasons"] == ["ledger_not_durable"]  # no reset
            assert f">{tag}<" in client.admin("GET", "/dashboard").text  # restored, listed
            audit = client.admin("GET", "/v1/admin/audit").json()["items"]
            assert [e["what"] for e in audit[:2]] == ["ledger.adopt", "ledger.restore"]
