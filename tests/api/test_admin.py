"""Admin routes: behind the admin token, closed without it."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import httpx
import pytest

from core.budgets import RESERVED_SCOPE_KINDS
from infra.redis_server import RedisServer
from tests.api.conftest import ADMIN_TOKEN, Client
from tests.api.test_cli import ceiling


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


def test_a_weekly_budget_resets_at_the_next_monday_in_its_time_zone(http: Client) -> None:
    """From outside: the week's reset is the next Monday 00:00 where the budget lives, as the
    admin read and the key's own read both say; the rate and per_user limits read back."""
    tag = f"org:w{uuid.uuid4().hex[:10]}"
    r = http.admin("PUT", f"/v1/admin/budgets/{tag}", json={
        "limits": [{"period": "week", "ceiling_micros": 7_000_000}],
        "timezone": "America/New_York",
        "rate": {"requests_per_minute": 60, "concurrent_max": 4},
        "per_user": {"limits": [{"period": "week", "ceiling_micros": 1_000_000}],
                     "users_max": 10}})
    assert r.status_code == 200, r.text
    body = http.admin("GET", f"/v1/admin/budgets/{tag}").json()
    assert body["rate"] == {"requests_per_minute": 60, "concurrent_max": 4}
    assert body["per_user"]["users_max"] == 10
    [week] = body["periods"]
    assert week["period"] == "week"
    resets = datetime.fromtimestamp(week["resets_at_ms"] / 1000, tz=ZoneInfo("America/New_York"))
    assert (resets.weekday(), resets.hour, resets.minute, resets.second) == (0, 0, 0, 0)
    now = datetime.now(tz=ZoneInfo("America/New_York"))
    assert timedelta(0) < resets - now <= timedelta(days=7)
    assert week["period_key"] == f"week:{(resets - timedelta(days=7)).isocalendar().year}-W" \
        f"{(resets - timedelta(days=7)).isocalendar().week:02d}"
    mine = http.get("/v1/budgets/me", headers={**http.sidecar_key(tag),
                                              "x-ceiling-user": "ann@example.com"})
    assert mine.status_code == 200, mine.text
    assert {(b["budget_id"], b["period"], b["resets_at_ms"]) for b in mine.json()["budgets"]} == {
        (tag, "week", week["resets_at_ms"]),
        (f"{tag}/user:ann@example.com", "week", week["resets_at_ms"])}
    assert mine.headers["x-ceiling-user-remaining-micros"] == "1000000"


def test_bad_budgets_are_422(http: Client) -> None:
    for path, body in [
        ("org:x{y}", {"limits": [{"period": "day", "ceiling_micros": 1}]}),
        ("org:x", {"limits": []}),
        ("org:x", {"limits": [{"period": "fortnight", "ceiling_micros": 1}]}),
        ("org:x", {"limits": [{"period": "day", "ceiling_micros": 1}], "timezone": "Nowhere"}),
        ("org:x", {"limits": [{"period": "day", "ceiling_micros": "1"}]}),
    ]:
        r = http.admin("PUT", f"/v1/admin/budgets/{path}", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request"), body


def test_admin_routes_need_the_admin_token(http: Client) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 10)
    api_key = http.sidecar_key(tag)
    for headers in ({}, {"Authorization": "Bearer wrong"}, api_key):
        r = http.get(f"/v1/admin/budgets/{tag}", headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized")
        r = http.post("/v1/admin/keys", headers=headers, json={"budget_id": tag})
        assert r.status_code == 401


def test_keys_need_a_budget_on_their_path(http: Client) -> None:
    r = http.admin("POST", "/v1/admin/keys", json={"budget_id": "org:nobody-here/key:k"})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request")


# Ids an operator may not name: a reserved scope kind (run, user) in the last scope or higher up.
RESERVED_PATHS = ("run:batch", "user:u1", "run:batch/team:t", "team:t/user:u1/key:k")


def refused_as_reserved(r: httpx.Response, kind: str) -> None:
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request"), r.text
    error = r.json()["error"]
    assert error["field"] == "budget_id"
    assert f"reserved kind '{kind}'" in error["message"]
    assert RESERVED_SCOPE_KINDS[kind] in error["message"]


@pytest.mark.parametrize("under", RESERVED_PATHS)
def test_an_operator_cannot_make_a_budget_of_a_reserved_scope_kind(
    http: Client, under: str
) -> None:
    """`org:x/run:batch` is where the ledger counts org:x's keys' run `batch`: a budget of that
    id would share its counters with the run. Refused, and nothing is written."""
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 1_000)
    kind = "run" if under.startswith("run:") or "/run:" in under else "user"
    r = http.admin("PUT", f"/v1/admin/budgets/{tag}/{under}", json={
        "limits": [{"period": "total", "ceiling_micros": 1_000}]})
    refused_as_reserved(r, kind)
    assert http.admin("GET", f"/v1/admin/budgets/{tag}/{under}").status_code == 404
    listed = http.admin("GET", "/v1/admin/budgets", params={"prefix": tag}).json()
    assert [b["budget_id"] for b in listed["items"]] == [tag]
    audit = http.admin("GET", "/v1/admin/audit", params={"limit": 100}).json()["items"]
    assert not [e for e in audit if f"{tag}/" in json.dumps(e)]


@pytest.mark.parametrize("under", RESERVED_PATHS)
def test_no_key_is_made_for_a_reserved_scope_kind(http: Client, under: str) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 1_000)
    kind = "run" if under.startswith("run:") or "/run:" in under else "user"
    r = http.admin("POST", "/v1/admin/keys", json={"budget_id": f"{tag}/{under}",
                                                    "run_ceiling_micros": 100})
    refused_as_reserved(r, kind)
    assert "api_key" not in r.text
    for budget_id in (tag, f"{tag}/{under}"):
        keys = http.admin("GET", "/v1/admin/keys", params={"budget_id": budget_id}).json()
        assert keys["items"] == [], budget_id


def test_the_command_line_refuses_a_reserved_scope_kind_too(
    redis_server: RedisServer, http: Client
) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 1_000)
    made = ceiling(redis_server, "budgets", "set", f"{tag}/run:batch", "--limit", "total=$1")
    assert made.returncode == 1
    error = json.loads(made.stderr)["error"]
    assert (error["code"], error["field"]) == ("invalid_request", "budget_id")
    assert http.admin("GET", f"/v1/admin/budgets/{tag}/run:batch").status_code == 404
    key = ceiling(redis_server, "keys", "create", f"{tag}/user:u1", "--run-ceiling", "100")
    assert key.returncode == 1
    assert json.loads(key.stderr)["error"]["code"] == "invalid_request"
    assert http.admin("GET", "/v1/admin/keys", params={"budget_id": f"{tag}/user:u1"}
                      ).json()["items"] == []


def test_the_secret_is_never_echoed_in_errors(http: Client) -> None:
    secret = "sk-ceil-" + "x" * 40
    r = http.post("/v1/reservations", headers={"Authorization": f"Bearer {secret}"},
                  json={"amount_micros": 1})
    assert secret not in r.text
    r = http.get("/v1/admin/budgets/org:x", headers={"Authorization": "Bearer admin-guess"})
    assert "admin-guess" not in r.text


def test_keys_get_the_roles_they_are_given_and_the_gateway_role_by_default(http: Client) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 10)
    made = http.admin("POST", "/v1/admin/keys", json={"budget_id": tag})
    assert made.json()["roles"] == ["gateway"]
    both = http.admin("POST", "/v1/admin/keys",
                      json={"budget_id": tag, "roles": ["sidecar", "gateway", "sidecar"]})
    assert both.json()["roles"] == ["gateway", "sidecar"]
    for roles in ([], ["admin"], "sidecar", [None]):
        r = http.admin("POST", "/v1/admin/keys", json={"budget_id": tag, "roles": roles})
        assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request"), roles


def held(http: Client, tag: str, amount_micros: int = 100) -> tuple[dict[str, str], str]:
    key = http.sidecar_key(tag)
    r = http.post("/v1/reservations", headers=key, json={"amount_micros": amount_micros})
    assert r.status_code == 201, r.text
    return key, r.json()["reservation_id"]


def correct(http: Client, rid: str, **body: object) -> tuple[int, dict[str, object]]:
    r = http.admin("POST", f"/v1/admin/reservations/{rid}/settle",
                   json={"actual_micros": 30, "reason": "provider bill #1", **body})
    return r.status_code, r.json()


def test_an_operator_corrects_a_reservation_by_its_id_alone(http: Client) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 1_000)
    key, rid = held(http, tag)
    status, answer = correct(http, rid)
    assert status == 200, answer
    assert {k: answer[k] for k in ("reservation_id", "charged_micros", "released_micros",
                                   "replayed")} == {
        "reservation_id": rid, "charged_micros": 30, "released_micros": 70, "replayed": False}
    by = answer["corrected_by"]
    assert isinstance(by, str)
    assert by.startswith("admin:")
    assert ADMIN_TOKEN not in by
    shown = http.admin("GET", f"/v1/admin/reservations/{rid}").json()
    assert {k: shown[k] for k in ("state", "outcome", "made_by", "reserved_micros",
                                  "charged_micros", "corrected_by", "corrected_from_micros",
                                  "correction_reason")} == {
        "state": "settled", "outcome": "corrected", "made_by": "sidecar", "reserved_micros": 100,
        "charged_micros": 30, "corrected_by": by, "corrected_from_micros": 100,
        "correction_reason": "provider bill #1"}
    assert shown["corrected_at_ms"] == shown["resolved_ms"] >= shown["created_ms"]
    me = http.get("/v1/budgets/me", headers=key).json()["budgets"][0]
    assert (me["committed_micros"], me["reserved_micros"]) == (30, 0)
    # Safe to repeat; another amount is a conflict; the books do not move either way.
    assert correct(http, rid)[1]["replayed"] is True
    assert correct(http, rid, actual_micros=31)[0] == 409
    assert http.get("/v1/budgets/me", headers=key).json()["budgets"][0]["committed_micros"] == 30


def test_an_operator_cannot_correct_what_its_caller_settled(http: Client) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 1_000)
    key, rid = held(http, tag)
    http.post(f"/v1/reservations/{rid}/settle", headers=key, json={"actual_micros": 50})
    status, answer = correct(http, rid)
    error = answer["error"]
    assert isinstance(error, dict)
    assert (status, error["code"], error["state"], error["charged_micros"]) == (
        409, "reservation_resolved", "settled", 50)


@pytest.mark.parametrize(("rid", "body", "status"), [
    ("0123456789abcdef_" + "0" * 32, {}, 404),  # a well-formed id nobody minted
    ("0123456789abcdef0123456789abcdef", {}, 404),  # an id that names no tag
    ("{x}", {}, 404),
    ("VALID", {"reason": ""}, 422),
    ("VALID", {"reason": "x" * 501}, 422),
    ("VALID", {"actual_micros": -1}, 422),
    ("VALID", {"actual_micros": "30"}, 422),
    ("VALID", {"budget_id": "org:somebody-else"}, 422),  # the id alone names its budget
    ("VALID", {"unknown": 1}, 422),
])
def test_bad_corrections_are_refused_and_change_nothing(
    http: Client, rid: str, body: dict[str, object], status: int
) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 1_000)
    key, made = held(http, tag)
    got, answer = correct(http, made if rid == "VALID" else rid, **body)
    assert got == status, answer
    me = http.get("/v1/budgets/me", headers=key).json()["budgets"][0]
    assert (me["committed_micros"], me["reserved_micros"]) == (0, 100)


def test_corrections_need_the_admin_token(http: Client) -> None:
    tag = f"org:a{uuid.uuid4().hex[:10]}"
    http.budget(tag, 1_000)
    key, rid = held(http, tag)
    for headers in ({}, {"Authorization": "Bearer wrong"}, key):
        r = http.post(f"/v1/admin/reservations/{rid}/settle", headers=headers,
                      json={"actual_micros": 0, "reason": "mine"})
        assert r.status_code == 401
        assert http.get(f"/v1/admin/reservations/{rid}", headers=headers).status_code == 401
    assert http.get("/v1/budgets/me", headers=key).json()["budgets"][0]["reserved_micros"] == 100
