"""GET /v1/admin/budgets/{id}/users and DELETE of a budget with end users, over HTTP on a real
service process and Redis: each user's spend as the user's own read shows it, a page at a time,
and nothing of a user left once its budget is deleted."""

from __future__ import annotations

import base64
import uuid

import pytest

from tests.api.conftest import Client

PER_USER = {"limits": [{"period": "day", "ceiling_micros": 1_000_000},
                       {"period": "total", "ceiling_micros": 3_000_000}],
            "users_max": 10, "rate": {"requests_per_minute": 100, "concurrent_max": 4}}
# Sent in this order; listed in byte order.
USERS = ("carol", "bob:1", "alice@example.com", "team:x")


def as_user(key: dict[str, str], user: str) -> dict[str, str]:
    return {**key, "X-Ceiling-User": user}


def spend(http: Client, headers: dict[str, str], micros: int) -> None:
    r = http.post("/v1/reservations", headers=headers, json={"amount_micros": micros})
    assert r.status_code == 201, r.text
    settled = http.post(f"/v1/reservations/{r.json()['reservation_id']}/settle",
                        headers=headers, json={"actual_micros": micros})
    assert settled.status_code == 200, settled.text


def put_budget(http: Client, budget_id: str, per_user: object = PER_USER) -> None:
    body: dict[str, object] = {"limits": [{"period": "total", "ceiling_micros": 10_000_000}]}
    if per_user is not None:
        body["per_user"] = per_user
    r = http.admin("PUT", f"/v1/admin/budgets/{budget_id}", json=body)
    assert r.status_code == 200, r.text


def listing(http: Client, budget_id: str, **params: object) -> dict[str, object]:
    r = http.admin("GET", f"/v1/admin/budgets/{budget_id}/users", params=params)
    assert r.status_code == 200, r.text
    found = r.json()
    assert isinstance(found, dict)
    return found


def test_users_page_in_byte_order_each_as_its_own_read_shows_it(http: Client) -> None:
    tag = f"org:u{uuid.uuid4().hex[:10]}"
    put_budget(http, tag)
    # A user id shaped like a scope of the budget's path: it is a user of the budget, and the
    # budget of that scope (which has one) is not charged.
    put_budget(http, f"{tag}/team:x", None)
    key = http.sidecar_key(tag)
    for i, user in enumerate(USERS):
        spend(http, as_user(key, user), 100_000 * (i + 1))
    spend(http, key, 50_000)  # a call that names no user: the budget's alone

    listed, cursor = [], None
    while True:
        page = listing(http, tag, limit=3, **({"cursor": cursor} if cursor else {}))
        assert (page["budget_id"], page["users_count"], page["users_max"]) == (tag, 4, 10)
        users = page["users"]
        assert isinstance(users, list)
        assert len(users) <= 3
        listed += users
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert [u["user"] for u in listed] == sorted(USERS)
    for u in listed:
        assert u["budget_id"] == f"{tag}/user:{u['user']}"
        mine = http.get("/v1/budgets/me", headers=as_user(key, u["user"]))
        assert mine.status_code == 200, mine.text
        assert u["budgets"] == [b for b in mine.json()["budgets"]
                                if b["budget_id"] == u["budget_id"]]
        assert [b["period"] for b in u["budgets"]] == ["day", "total"]
        assert int(mine.headers["x-ceiling-user-remaining-micros"]) == min(
            b["remaining_micros"] for b in u["budgets"])
    committed = {u["user"]: u["budgets"][-1]["committed_micros"] for u in listed}
    assert committed == {user: 100_000 * (i + 1) for i, user in enumerate(USERS)}
    # The users' spend is part of the budget's, with the call that named none.
    total = http.admin("GET", f"/v1/admin/budgets/{tag}").json()["periods"][0]
    assert total["committed_micros"] == sum(committed.values()) + 50_000
    scope = http.admin("GET", f"/v1/admin/budgets/{tag}/team:x").json()["periods"][0]
    assert scope["committed_micros"] == 0


def test_the_listing_refuses_what_it_did_not_give(http: Client) -> None:
    tag = f"org:u{uuid.uuid4().hex[:10]}"
    put_budget(http, tag)
    path = f"/v1/admin/budgets/{tag}/users"
    assert http.get(path).status_code == 401
    assert http.admin("GET", f"/v1/admin/budgets/org:none{uuid.uuid4().hex[:8]}/users"
                      ).json()["error"]["code"] == "budget_not_found"
    not_a_user = base64.urlsafe_b64encode(b"has/slash").decode().rstrip("=")
    for params in ({"limit": 0}, {"limit": 1001}, {"limit": "many"}, {"cursor": "!!"},
                   {"cursor": not_a_user}):
        r = http.admin("GET", path, params=params)
        assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_request"), params
    # A budget whose last scope is named 'users' is read as a budget, not as a users list.
    put_budget(http, f"{tag}/team:users", None)
    found = http.admin("GET", f"/v1/admin/budgets/{tag}/team:users")
    assert (found.status_code, found.json()["budget_id"]) == (200, f"{tag}/team:users")


def test_a_budget_without_per_user_lists_none(http: Client) -> None:
    tag = f"org:u{uuid.uuid4().hex[:10]}"
    put_budget(http, tag, None)
    assert listing(http, tag) == {"budget_id": tag, "users": [], "users_count": 0,
                                  "users_max": None, "next_cursor": None}


@pytest.mark.parametrize("force", [False, True])
def test_delete_uncounts_the_users_and_refills_none_of_them(
    http: Client, force: bool
) -> None:
    tag = f"org:u{uuid.uuid4().hex[:10]}"
    put_budget(http, tag)
    key = http.sidecar_key(tag)
    for user in USERS[:3]:
        spend(http, as_user(key, user), 1_000_000)  # each at its day ceiling
    if force:
        held = http.post("/v1/reservations", headers=as_user(key, "dave"),
                         json={"amount_micros": 10_000})
        assert held.status_code == 201
        refused = http.admin("DELETE", f"/v1/admin/budgets/{tag}")
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "budget_in_use")
        # dave holds a pending place (a call open, nothing charged yet): not counted
        assert listing(http, tag)["users_count"] == 3  # nothing changed
    r = http.admin("DELETE", f"/v1/admin/budgets/{tag}", params={"force": force})
    assert r.status_code == 200, r.text
    assert (r.json()["users_deleted"], r.json()["reservations_charged_as_unknown"]) == (
        (4, 1) if force else (3, 0))
    assert http.admin("GET", f"/v1/admin/budgets/{tag}/users").status_code == 404
    put_budget(http, tag)
    assert listing(http, tag)["users_count"] == 0
    key = http.sidecar_key(tag)
    # A user at its day's ceiling before the delete still is: nothing refilled.
    refused = http.post("/v1/reservations", headers=as_user(key, USERS[0]),
                        json={"amount_micros": 1})
    assert (refused.status_code, refused.json()["error"]["code"]) == (402, "budget_exceeded")
    spend(http, as_user(key, "erin"), 1_000_000)  # a new user has its own day
    [again] = listing(http, tag)["users"]
    assert (again["user"], again["budgets"][0]["committed_micros"]) == ("erin", 1_000_000)
