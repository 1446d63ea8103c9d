"""Admin routes: behind the admin token, closed without it."""

from __future__ import annotations

import uuid

from tests.api.conftest import Client


def test_budgets_are_created_read_and_replaced(http: Client) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    r = http.admin("PUT", f"/v1/admin/budgets/{tag}/team:x", json={
        "limits": [{"period": "day", "ceiling_micros": 5_000_000},
                   {"period": "month", "ceiling_micros": 50_000_000}],
        "timezone": "Europe/Berlin", "outage_allowance_micros": 10})
    assert r.status_code == 200, r.text
    body = http.admin("GET", f"/v1/admin/budgets/{tag}/team:x").json()
    assert body["timezone"] == "Europe/Berlin"
    assert [p["period"] for p in body["periods"]] == ["day", "month"]
    day = body["periods"][0]
    assert set(day) >= {"committed_micros", "reserved_micros", "remaining_micros",
                        "period_key", "resets_at_ms"}
    assert day["remaining_micros"] == 5_000_000
    missing = http.admin("GET", f"/v1/admin/budgets/{tag}/team:none")
    assert missing.status_code == 404


def test_bad_budgets_are_422(http: Client) -> None:
    for path, body in [
        ("org:x{y}", {"limits": [{"period": "day", "ceiling_micros": 1}]}),
        ("org:x", {"limits": []}),
        ("org:x", {"limits": [{"period": "week", "ceiling_micros": 1}]}),
        ("org:x", {"limits": [{"period": "day", "ceiling_micros": 1}], "timezone": "Nowhere"}),
        ("org:x", {"limits": [{"period": "day", "ceiling_micros": "1"}]}),
    ]:
        r = http.admin("PUT", f"/v1/admin/budgets/{path}", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request"), body


def test_admin_routes_need_the_admin_token(http: Client) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 10)
    api_key = http.key(tag)
    for headers in ({}, {"Authorization": "Bearer wrong"}, api_key):
        r = http.get(f"/v1/admin/budgets/{tag}", headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized")
        r = http.post("/v1/admin/keys", headers=headers, json={"budget_id": tag})
        assert r.status_code == 401


def test_keys_need_a_budget_on_their_path(http: Client) -> None:
    r = http.admin("POST", "/v1/admin/keys", json={"budget_id": "org:nobody-here/key:k"})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request")


def test_the_secret_is_never_echoed_in_errors(http: Client) -> None:
    secret = "sk-ceil-" + "x" * 40
    r = http.post("/v1/reservations", headers={"Authorization": f"Bearer {secret}"},
                  json={"amount_micros": 1})
    assert secret not in r.text
    r = http.get("/v1/admin/budgets/org:x", headers={"Authorization": "Bearer admin-guess"})
    assert "admin-guess" not in r.text
