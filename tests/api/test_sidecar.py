"""The sidecar routes over real HTTP: every route, every error code, the auth boundaries."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.api.conftest import Client

# acme-llm is not in the bundled table: these tests price with gpt-4o ($2.50 in, $10 out / Mtok).
MODEL = "gpt-4o"


def org() -> str:
    return f"org:h{uuid.uuid4().hex[:10]}"


def test_price_reserve_settle_release(http: Client) -> None:
    tag = org()
    http.budget(tag, 1_000_000)
    key = http.sidecar_key(f"{tag}/team:a/key:k")
    r = http.post("/v1/reservations", headers=key, json={
        "model": MODEL, "input_tokens": 1_000, "max_output_tokens": 500})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["reserved_micros"] == 2_500 + 5_000
    assert body["budgets"][0]["remaining_micros"] == 1_000_000 - 7_500
    rid = body["reservation_id"]
    s = http.post(f"/v1/reservations/{rid}/settle", headers=key,
                  json={"input_tokens": 1_000, "output_tokens": 100})
    assert s.status_code == 200, s.text
    assert (s.json()["charged_micros"], s.json()["released_micros"]) == (3_500, 4_000)
    again = http.post(f"/v1/reservations/{rid}/settle", headers=key,
                      json={"input_tokens": 1_000, "output_tokens": 100})
    assert again.json()["replayed"] is True
    other = http.post(f"/v1/reservations/{rid}/settle", headers=key,
                      json={"input_tokens": 1_000, "output_tokens": 101})
    assert (other.status_code, other.json()["error"]["code"]) == (409, "idempotency_conflict")
    r2 = http.post("/v1/reservations", headers=key, json={"amount_micros": 100})
    rel = http.post(f"/v1/reservations/{r2.json()['reservation_id']}/release", headers=key)
    assert (rel.status_code, rel.json()["released_micros"]) == (200, 100)
    me = http.get("/v1/budgets/me", headers=key).json()
    assert me["budgets"][0]["committed_micros"] == 3_500
    assert me["budgets"][0]["reserved_micros"] == 0


def test_budget_exceeded_is_402_and_names_the_budget(http: Client) -> None:
    tag = org()
    http.budget(tag, 100, period="day")
    key = http.sidecar_key(tag)
    rid = http.post("/v1/reservations", headers=key, json={"amount_micros": 100}).json()
    busy = http.post("/v1/reservations", headers=key, json={"amount_micros": 1})
    assert busy.status_code == 429
    assert busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["code"] == "budget_busy"
    http.post(f"/v1/reservations/{rid['reservation_id']}/settle", headers=key,
              json={"actual_micros": 100})
    r = http.post("/v1/reservations", headers=key, json={"amount_micros": 1})
    assert r.status_code == 402
    error = r.json()["error"]
    assert (error["code"], error["budget_id"], error["period"], error["remaining_micros"]) == (
        "budget_exceeded", tag, "day", 0)
    assert 0 < error["retry_after_s"] <= 86_400
    assert "Retry-After" not in r.headers


def test_idempotency_key_returns_the_first_reservation(http: Client) -> None:
    tag = org()
    http.budget(tag, 1_000)
    key = {**http.sidecar_key(tag), "Idempotency-Key": "call-42"}
    first = http.post("/v1/reservations", headers=key, json={"amount_micros": 10})
    again = http.post("/v1/reservations", headers=key, json={"amount_micros": 10})
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["reservation_id"] == again.json()["reservation_id"]
    conflict = http.post("/v1/reservations", headers=key, json={"amount_micros": 11})
    assert (conflict.status_code, conflict.json()["error"]["code"]) == (409,
                                                                        "idempotency_conflict")


@pytest.mark.parametrize("body", [
    {"amount_micros": "10"}, {"amount_micros": 1.0}, {"amount_micros": -0.0},
    {"amount_micros": 0}, {"amount_micros": 2**53}, {"amount_micros": True},
    {"amount_micros": 10, "unknown": 1}, {"model": MODEL, "input_tokens": 10,
                                          "max_output_tokens": "10"},
    {"model": MODEL, "input_tokens": 10}, {}, [], "x",
    {"model": MODEL, "input_tokens": 10, "max_tokens": 5, "max_output_tokens": 6},
])
def test_bad_input_is_422_and_reserves_nothing(http: Client, body: object) -> None:
    tag = org()
    http.budget(tag, 1_000)
    key = http.sidecar_key(tag)
    r = http.post("/v1/reservations", headers=key, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert http.get("/v1/budgets/me", headers=key).json()["budgets"][0]["reserved_micros"] == 0


def test_an_unpriced_model_is_422_model_unpriced(http: Client) -> None:
    tag = org()
    http.budget(tag, 1_000)
    r = http.post("/v1/reservations", headers=http.sidecar_key(tag), json={
        "model": "model-launched-this-morning", "input_tokens": 1, "max_output_tokens": 1})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "model_unpriced")


def test_a_key_cannot_touch_another_keys_reservation(http: Client) -> None:
    tag, other_org = org(), org()
    http.budget(tag, 1_000)
    http.budget(other_org, 1_000)
    mine, neighbour = http.sidecar_key(tag), http.sidecar_key(tag)
    stranger = http.sidecar_key(other_org)
    rid = http.post("/v1/reservations", headers=mine, json={"amount_micros": 10}).json()[
        "reservation_id"]
    for key in (neighbour, stranger):
        for action in ("settle", "release"):
            r = http.post(f"/v1/reservations/{rid}/{action}", headers=key,
                          json={"actual_micros": 1} if action == "settle" else None)
            assert (r.status_code, r.json()["error"]["code"]) == (404, "reservation_not_found")
    assert http.get("/v1/budgets/me", headers=stranger).json()["budget_id"] == other_org


@pytest.mark.parametrize("auth", [None, "Bearer nope", "Bearer sk-ceil-nope", "Basic abc"])
def test_no_valid_key_is_401(http: Client, auth: str | None) -> None:
    headers = {"Authorization": auth} if auth else {}
    r = http.post("/v1/reservations", headers=headers, json={"amount_micros": 1})
    assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized")


def test_a_revoked_key_is_refused(http: Client) -> None:
    tag = org()
    http.budget(tag, 1_000)
    r = http.admin("POST", "/v1/admin/keys", json={"budget_id": tag})
    key_id, api_key = r.json()["key_id"], r.json()["api_key"]
    assert http.admin("DELETE", f"/v1/admin/keys/{key_id}").status_code == 200
    r = http.post("/v1/reservations", headers={"Authorization": f"Bearer {api_key}"},
                  json={"amount_micros": 1})
    assert r.status_code == 401


def test_a_run_has_its_own_ceiling_in_every_answer(http: Client) -> None:
    tag = org()
    http.budget(tag, 1_000)
    key = {**http.sidecar_key(tag, run_ceiling_micros=50), "X-Ceiling-Run-Id": "agent-7"}
    r = http.post("/v1/reservations", headers=key, json={"amount_micros": 50})
    assert [b["budget_id"] for b in r.json()["budgets"]] == [tag, f"{tag}/run:agent-7"]
    r = http.post("/v1/reservations", headers=key, json={"amount_micros": 1})
    assert (r.status_code, r.json()["error"]["budget_id"]) == (429, f"{tag}/run:agent-7")


def test_a_ten_megabyte_body_is_413(http: Client) -> None:
    r = http.post("/v1/reservations", content=b"{" + b" " * 10_000_000 + b"}",
                  headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()["error"]["code"]) == (413, "payload_too_large")


def test_a_ten_megabyte_chunked_body_is_413(http: Client) -> None:
    # No Content-Length to refuse it by: it is counted as it streams in.
    def chunks() -> Iterator[bytes]:
        yield b"{"
        for _ in range(10):
            yield b" " * 1_000_000
        yield b"}"

    tag = org()
    http.budget(tag, 1_000)
    r = http.post("/v1/reservations", content=chunks(),
                  headers={**http.sidecar_key(tag), "Content-Type": "application/json"})
    assert (r.status_code, r.json()["error"]["code"]) == (413, "payload_too_large")


def test_a_key_needs_the_sidecar_role_for_the_sidecar_routes(http: Client) -> None:
    tag = org()
    http.budget(tag, 1_000)
    gateway_only, sidecar = http.key(tag), http.sidecar_key(tag)
    rid = http.post("/v1/reservations", headers=sidecar, json={"amount_micros": 10}).json()[
        "reservation_id"]
    for path, body in (("/v1/reservations", {"amount_micros": 1}),
                       (f"/v1/reservations/{rid}/settle", {"actual_micros": 0}),
                       (f"/v1/reservations/{rid}/release", None)):
        r = http.post(path, headers=gateway_only, json=body)
        error = r.json()["error"]
        assert (r.status_code, error["code"], error["missing_role"]) == (
            403, "forbidden", "sidecar"), path
        assert "'sidecar' role" in error["message"]
    # Either role reads its own budgets.
    for key in (gateway_only, sidecar):
        assert http.get("/v1/budgets/me", headers=key).json()["budgets"][0][
            "reserved_micros"] == 10


@pytest.mark.parametrize(("resolve", "state", "charged"), [("settle", "settled", 4),
                                                           ("release", "released", 0)])
def test_a_replayed_reserve_after_its_call_was_resolved_says_what_happened(
    http: Client, resolve: str, state: str, charged: int
) -> None:
    tag = org()
    http.budget(tag, 1_000)
    key = {**http.sidecar_key(tag), "Idempotency-Key": "call-7"}
    rid = http.post("/v1/reservations", headers=key, json={"amount_micros": 10}).json()[
        "reservation_id"]
    http.post(f"/v1/reservations/{rid}/{resolve}", headers=key,
              json={"actual_micros": 4} if resolve == "settle" else None)
    replay = http.post("/v1/reservations", headers=key, json={"amount_micros": 10})
    error = replay.json()["error"]
    assert replay.status_code == 409, replay.text
    assert {k: error[k] for k in ("code", "reservation_id", "state", "reserved_micros",
                                  "charged_micros")} == {
        "code": "reservation_resolved", "reservation_id": rid, "state": state,
        "reserved_micros": 10, "charged_micros": charged}
    budgets = http.get("/v1/budgets/me", headers=key).json()["budgets"][0]
    assert (budgets["committed_micros"], budgets["reserved_micros"]) == (charged, 0)
