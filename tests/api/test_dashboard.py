"""The spend page (issue 16) in a real headless Chromium (Debian's `chromium`, driven by
Playwright): sign-in, the numbers against the ledger's, the chart's points against the ledger's
hourly buckets, the CSP, and no request to another host."""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from api.routes.dashboard import render, tree_tops, usd
from core import spend as spend_report
from core.budgets import BudgetId
from core.ledger import OpenHold, OpenLeases, Probe, RunSpend
from core.limits import RESERVATION_TTL_MS_MIN, SPEND_BUCKET_MS, SPEND_BUCKET_RETENTION_MS
from core.stores import keys
from core.stores.operations import KeyInfo
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from tests.api.conftest import ADMIN_TOKEN, Client, client_for
from tests.api.test_alerts import budget, spend

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-background-networking", "--no-first-run"]
# Where the docs' screenshot is refreshed from, when a run asks for it
# (CEILING_REFRESH_SCREENSHOT=1): a test run leaves the checkout as it found it.
README_SCREENSHOT = Path(__file__).parents[2] / "docs" / "dashboard.png"
RUN_ID = "r-page"
RUN_CEILING_MICROS = 20_000_000
# Past a lease by this much on the machine's clock, so the ledger's (Redis TIME) is past it too.
LEASE_MARGIN_MS = 200
# The headline as the route serves it: the amount over "spent in N h".
HEADLINE = re.compile(r"<b>([^<]*)</b><span>spent in ")

playwright_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def page_service(redis_server: RedisServer) -> Iterator[Client]:
    env = {"REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}
    with ServiceProcess(env) as s, client_for(s) as c:
        yield c


def seed_hours(redis_server: RedisServer, budget_id: str, now_hour: int,
               micros_by_hours_ago: dict[int, int]) -> None:
    """Spend booked in earlier hours, as the ledger's settles would have left it."""
    raw = redis.Redis.from_url(redis_server.url)
    bid = BudgetId(budget_id)
    for ago, micros in micros_by_hours_ago.items():
        key = keys.spend(bid.tag, bid.path, now_hour - ago)
        raw.incrby(key, micros)
        raw.pexpire(key, SPEND_BUCKET_RETENTION_MS)
    raw.close()


# Slow: a real headless browser costs more CPU than the rest of this module together; CI runs it.
@pytest.mark.slow
def test_the_page_in_chromium(page_service: Client, redis_server: RedisServer,
                              tmp_path: Path) -> None:
    if shutil.which("chromium") is None:
        pytest.fail("chromium is missing: bash infra/setup.sh installs it")
    http = page_service
    tag = f"org:d{uuid.uuid4().hex[:8]}"
    team = f"{tag}/team:search"
    r = http.admin("PUT", f"/v1/admin/budgets/{tag}", json={
        "limits": [{"period": "day", "ceiling_micros": 50_000_000},
                   {"period": "month", "ceiling_micros": 900_000_000}],
        "alerts": {"thresholds_pct": [50, 80, 100]}})
    assert r.status_code == 200
    budget(http, team, 4_000_000, {"thresholds_pct": [50, 80, 100]})
    key = http.sidecar_key(team)
    for micros in (900_000, 1_200_000, 600_000, 700_000):
        assert spend(http, key, micros).status_code == 200
    held = http.post("/v1/reservations", headers=key, json={"amount_micros": 250_000})
    assert held.status_code == 201  # open: shows as reserved
    # An agent's run: spend booked in it, and a call of it open now (what makes it live).
    agents = f"{tag}/team:agents"
    budget(http, agents, 40_000_000, {"thresholds_pct": [50, 80, 100]})
    run_key = {**http.sidecar_key(agents, RUN_CEILING_MICROS), "X-Ceiling-Run-Id": RUN_ID}
    assert spend(http, run_key, 1_700_000).status_code == 200
    in_run = http.post("/v1/reservations", headers=run_key, json={"amount_micros": 300_000})
    assert in_run.status_code == 201
    # A call whose caller never settles it: past its short lease its outcome is unknown. The
    # tag's last reserve, since a later one may expire it (lua/reserve.lua reclaims).
    lost = http.post("/v1/reservations", headers=key,
                     json={"amount_micros": 125_000, "ttl_ms": RESERVATION_TTL_MS_MIN})
    assert lost.status_code == 201
    # A team whose calls may name two models, one of them limited on its own: settled, so the
    # open reservations counted below stay the three above.
    models_team = f"{tag}/team:models"
    assert http.admin("PUT", f"/v1/admin/budgets/{models_team}", json={
        "limits": [{"period": "day", "ceiling_micros": 5_000_000}],
        "models": {"allow": ["gpt-4o", "claude-haiku-4-5"]},
        "per_model": {"gpt-4o": {"limits": [{"period": "day", "ceiling_micros": 1_000_000}]}},
    }).status_code == 200
    models_key = http.sidecar_key(models_team)
    by_model = http.post("/v1/reservations", headers=models_key, json={
        "model": "gpt-4o", "input_tokens": 10, "max_output_tokens": 10})
    assert by_model.status_code == 201, by_model.text
    assert http.post(f"/v1/reservations/{by_model.json()['reservation_id']}/settle",
                     headers=models_key, json={"actual_micros": 80_000}).status_code == 200
    # The ledger's hour (Redis TIME on this machine's clock), which the settles above used.
    hour = int(time.time() * 1000) // SPEND_BUCKET_MS
    history = {ago: 150_000 + (ago * 37_000) % 400_000 for ago in range(1, 40)}
    seed_hours(redis_server, team, hour, history)
    seed_hours(redis_server, agents, hour, history)
    seed_hours(redis_server, tag, hour, {a: m * 3 for a, m in history.items()})
    assert http.admin("PUT", f"/v1/admin/budgets/{tag}/<script>alert(1)</script>", json={
        "limits": [{"period": "day", "ceiling_micros": 1}]}).status_code == 422
    ledger = {b: http.admin("GET", f"/v1/admin/budgets/{b}").json()
              for b in (tag, team, models_team)}
    series = {b["budget_id"]: b["series"] for b in
              http.get("/v1/usage/me", headers=key, params={"hours": "48"}).json()["budgets"]}
    [run_leg] = [b for b in http.get("/v1/budgets/me", headers=run_key).json()["budgets"]
                 if b["budget_id"] == f"{agents}/run:{RUN_ID}"]
    bound = {b: {k["key_id"] for k in http.admin("GET", "/v1/admin/keys",
                                                  params={"budget_id": b}).json()["items"]}
             for b in (team, agents)}
    assert all(bound.values())
    stored = {r.json()["reservation_id"]: http.admin(
        "GET", f"/v1/admin/reservations/{r.json()['reservation_id']}").json()
        for r in (held, in_run, lost)}
    while int(time.time() * 1000) <= lost.json()["expires_at_ms"] + LEASE_MARGIN_MS:
        time.sleep(0.05)

    errors: list[str] = []
    hosts: set[str] = set()
    blocked: list[str] = []
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        context = browser.new_context(viewport={"width": 1360, "height": 1000})
        page = context.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        # Requests that got an answer, and those the browser stopped (with why).
        page.on("requestfinished", lambda req: hosts.add(urlsplit(req.url).hostname or ""))
        page.on("requestfailed", lambda req: blocked.append(f"{req.url} {req.failure}"))

        answer = page.goto(f"{http.base_url}/dashboard")
        assert answer is not None
        assert answer.status == 401
        page.fill("#token", "not-the-token")
        page.click("button[type=submit]")
        assert "not the admin token" in page.inner_text("[role=alert]")
        assert context.cookies() == []
        page.fill("#token", ADMIN_TOKEN)
        page.click("button[type=submit]")
        page.wait_for_selector("#health")
        [cookie] = context.cookies()
        assert (cookie["httpOnly"], cookie["sameSite"]) == (True, "Strict")
        assert ADMIN_TOKEN not in cookie["value"]
        # Errors from here on are the page's own; the 401 of the sign-in form was logged.
        errors.clear()
        page.reload()
        page.wait_for_selector("#health")

        for b in (tag, team):
            card = page.locator(f"section.card[data-budget='{b}']")
            for period in ledger[b]["periods"]:
                row = card.locator(f"tr[data-window='{period['period_key']}']")
                for field in ("ceiling_micros", "committed_micros", "reserved_micros",
                              "remaining_micros"):
                    shown = row.locator(f"td[data-field='{field}']").get_attribute("data-micros")
                    assert int(shown or "-1") == period[field], (b, period["period_key"], field)
            points = card.locator("svg.chart rect.pt")
            drawn = {int(points.nth(i).get_attribute("data-hour-ms") or 0):
                     int(points.nth(i).get_attribute("data-micros") or 0)
                     for i in range(points.count())}
            assert drawn == {s["hour_start_ms"]: s["committed_micros"] for s in series[b]}
            assert len(drawn) >= 40
            assert all(points.nth(i).bounding_box() for i in range(3))  # rendered, with a size
        card = page.locator(f"section.card[data-budget='{models_team}']")
        assert card.locator("[data-models-allow]").inner_text() == (
            "models: claude-haiku-4-5, gpt-4o")
        [gpt_day] = ledger[models_team]["per_model_periods"]["gpt-4o"]
        row = card.locator(f"tr[data-model='gpt-4o'][data-window='{gpt_day['period_key']}']")
        for field in ("ceiling_micros", "committed_micros", "reserved_micros",
                      "remaining_micros"):
            shown = row.locator(f"td[data-field='{field}']").get_attribute("data-micros")
            assert int(shown or "-1") == gpt_day[field], field
        assert gpt_day["committed_micros"] == 80_000
        assert row.bounding_box()  # rendered, with a size
        team_row = page.locator(f"section.card[data-budget='{team}'] tr[data-period='day']")
        assert team_row.locator("td[data-field='committed_micros']").inner_text() == "$3.40"
        see_lists(page, tag, stored, lost.json()["reservation_id"], run_leg, bound)
        assert errors == []
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        if os.environ.get("CEILING_REFRESH_SCREENSHOT") == "1":
            # Refreshed from this test run alone, on a ledger holding this organisation only:
            # the headline is its spend, its teams' included once.
            org_micros = page.locator(f"section.card[data-budget='{tag}'] header [data-micros]")
            assert page.locator("#spent").get_attribute("data-micros") == (
                org_micros.get_attribute("data-micros"))
            page.screenshot(path=str(README_SCREENSHOT), full_page=False)

        # The CSP: a script put into the page does not run, and nothing leaves for another host.
        page.evaluate("""() => {
            const s = document.createElement('script');
            s.textContent = 'window.pwned = 1';
            document.body.appendChild(s);
            document.body.insertAdjacentHTML('beforeend',
              '<img src="https://evil.example/x.png"><img src=x onerror="window.pwned=2">');
        }""")
        page.wait_for_timeout(300)
        assert page.evaluate("() => window.pwned") is None
        assert any("Content Security Policy" in e for e in errors), errors
        assert hosts == {"127.0.0.1"}, hosts
        assert any("evil.example" in b and "csp" in b.lower() for b in blocked), blocked

        page.click("text=Sign out")
        page.wait_for_selector("#token")
        assert context.cookies() == []
        browser.close()


def see_lists(page: Any, tag: str, stored: dict[str, dict[str, Any]], lost_id: str,
              run_leg: dict[str, Any], bound: dict[str, set[str]]) -> None:
    """The open and overdue reservations, the live run and the keys as the page shows them,
    against what the ledger holds (the admin reads of each)."""
    counts = page.locator(f"#leases tr[data-tag='{tag}'] td.num")
    assert [counts.nth(i).inner_text() for i in range(2)] == ["3", "1"]
    for rid, view in stored.items():
        assert view["state"] == "open"
        table = "#overdue" if rid == lost_id else "#open"
        row = page.locator(f"{table} tr[data-reservation='{rid}']")
        assert row.count() == 1, (table, rid)
        assert int(row.get_attribute("data-micros") or -1) == view["reserved_micros"]
        assert int(row.get_attribute("data-expires-ms") or -1) == view["expires_at_ms"]
        assert view["key_id"] in row.inner_text()
    assert "ended" in page.locator(f"#overdue tr[data-reservation='{lost_id}']").inner_text()
    run = page.locator(f"#runs tr[data-run='{run_leg['budget_id']}']")
    for field in ("committed_micros", "reserved_micros", "ceiling_micros"):
        shown = run.locator(f"td[data-field='{field}']").get_attribute("data-micros")
        assert int(shown or -1) == run_leg[field], field
    assert (run_leg["committed_micros"], run_leg["ceiling_micros"]) == (
        1_700_000, RUN_CEILING_MICROS)
    assert RUN_ID in run.inner_text()
    for budget_id, key_ids in bound.items():
        rows = page.locator(f"#keys tr[data-budget='{budget_id}']")
        shown = {rows.nth(i).get_attribute("data-key") for i in range(rows.count())}
        assert shown == key_ids, budget_id


def test_free_text_on_the_page_is_escaped() -> None:
    hostile = "org:x/<script>alert(1)</script>"
    report = spend_report.BudgetReport(hostile, None, (), ())
    hold = OpenHold("<i>rid", "gw:<i>owner", (hostile,), f"{hostile}/run:<i>r", 5, 0, 1)
    leases = OpenLeases(hostile, 2, 1, 1, (hold,), (), (RunSpend(f"{hostile}/run:<i>r", 9, 1, 5,
                                                                  None),))
    keys = (spend_report.BudgetKeys(hostile, (KeyInfo("<i>key", hostile, ("<i>role",), None,
                                                      None, None, None, None),), True),)
    view = spend_report.Overview(
        0, 24, (report,), (), (leases,),
        Probe("redis", True, True, 0.1, "id", True, ("<b>reason</b>",), 1), keys)
    html = render(view)
    assert "<script>" not in html
    assert "<b>reason" not in html
    assert "<i>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count("&lt;i&gt;") >= 6  # the id, owner, run, key and role are all shown


def test_the_headline_adds_the_tops_of_the_budget_trees() -> None:
    """Without a browser: the headline adds the budgets no ancestor of which is on the page."""
    def report(budget_id: str, micros: int) -> spend_report.BudgetReport:
        return spend_report.BudgetReport(
            budget_id, None, (), (spend_report.SpendPoint(0, micros),))

    budgets = (report("org:a", 1_200_000), report("org:a/team:t", 200_000),
               report("org:a/team:t/project:p", 50_000), report("org:b/team:x/project:y", 300_000),
               report("org:b/team:x/project:y/agent:q", 10_000), report("org:ab", 7))
    view = spend_report.Overview(0, 24, budgets, (), (),
                                 Probe("redis", True, True, 0.1, "id", True, (), 1))
    assert [b.budget_id for b in tree_tops(budgets)] == [
        "org:a", "org:b/team:x/project:y", "org:ab"]
    html = render(view)
    assert "id=spent data-micros='1500007'" in html
    assert HEADLINE.findall(html) == ["$1.50"]


def test_a_key_holder_sees_none_of_the_operators_lists(page_service: Client,
                                                       redis_server: RedisServer) -> None:
    """The page's lists (open and overdue reservations, runs, keys) are the operator's: a key's
    bearer token gets the sign-in form, and its own reads name no reservation, run or other
    key."""
    http = page_service
    tag = f"org:h{uuid.uuid4().hex[:8]}"
    budget(http, tag, 10_000_000, {"thresholds_pct": [50]})
    mine = http.sidecar_key(f"{tag}", 5_000_000)
    theirs = {**http.sidecar_key(f"{tag}", 5_000_000), "X-Ceiling-Run-Id": "their-run"}
    assert spend(http, theirs, 400_000).status_code == 200
    open_call = http.post("/v1/reservations", headers=theirs, json={"amount_micros": 70_000})
    assert open_call.status_code == 201
    # Among the top spenders whatever else this Redis holds, so the page lists its keys.
    seed_hours(redis_server, tag, int(time.time() * 1000) // SPEND_BUCKET_MS, {1: 10**11})
    secrets = [open_call.json()["reservation_id"], "their-run",
               *(k["key_id"] for k in http.admin("GET", "/v1/admin/keys",
                                                  params={"budget_id": tag}).json()["items"])]
    admin_page = http.admin("GET", "/dashboard").text
    assert all(s in admin_page for s in secrets)  # the admin sees each of them
    for key in (mine, theirs):
        page = http.get("/dashboard", headers=key)
        assert page.status_code == 401
        assert 'id="token"' in page.text or "id=token" in page.text
        for path in ("/v1/usage/me", "/v1/budgets/me"):
            answer = http.get(path, headers=key)
            assert answer.status_code == 200, (path, answer.text)
            # A key's own run is in its own budgets' read; nothing else of the lists is.
            own_run = key is theirs and path == "/v1/budgets/me"
            leaked = [s for s in secrets if s in answer.text
                      and not (own_run and s == "their-run")]
            assert leaked == [], (path, leaked)
        assert http.get("/dashboard", headers={**key, "Cookie": "ceiling_session=" + key[
            "Authorization"].removeprefix("Bearer ")}).status_code == 401


def test_sign_in_is_refused_from_another_origin_and_the_cookie_is_secure_behind_tls(
    page_service: Client,
) -> None:
    http = page_service
    form = {"token": ADMIN_TOKEN}
    forged = http.post("/dashboard/sign-in", data=form,
                       headers={"Origin": "https://evil.example"})
    assert forged.status_code == 403
    assert "set-cookie" not in forged.headers
    assert http.post("/dashboard/sign-out",
                     headers={"Origin": "https://evil.example"}).status_code == 403
    ok = http.post("/dashboard/sign-in", data=form, headers={"x-forwarded-proto": "https"})
    assert ok.status_code == 303
    cookie = ok.headers["set-cookie"]
    for part in ("HttpOnly", "Secure", "SameSite=strict", "Path=/dashboard"):
        assert part.lower() in cookie.lower(), cookie
    assert ADMIN_TOKEN not in cookie
    # The cookie reads the page; it is not an admin credential for the API.
    session = cookie.split(";", 1)[0].split("=", 1)[1]
    tampered = session[:-1] + ("0" if session[-1] != "0" else "1")
    assert http.get("/dashboard", headers={"Cookie": f"ceiling_session={session}"}
                    ).status_code == 200
    assert http.get("/v1/admin/alerts",
                    headers={"Authorization": f"Bearer {session}"}).status_code == 401
    assert http.get("/dashboard", headers={"Cookie": f"ceiling_session={tampered}"}
                    ).status_code == 401
    assert http.get("/dashboard",
                    headers={"Authorization": "Bearer wrong"}).status_code == 401


@pytest.fixture(scope="module")
def tree_service() -> Iterator[Client]:
    """An instance on a ledger of its own: the headline adds up every budget on the page, so no
    other test's budgets may be on it."""
    with RedisServer() as server, ServiceProcess(
            {"REDIS_URL": server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
             "CEILING_ACCEPT_NOT_DURABLE": "1"}) as s, \
            client_for(s) as c:
        yield c


def charge(http: Client, budget_id: str, actual_micros: int) -> None:
    """One call by a key of `budget_id`: reserved at twice its cost, settled at its cost."""
    key = http.sidecar_key(budget_id)
    held = http.post("/v1/reservations", headers=key, json={"amount_micros": 2 * actual_micros})
    assert held.status_code == 201, held.text
    settled = http.post(f"/v1/reservations/{held.json()['reservation_id']}/settle", headers=key,
                        json={"actual_micros": actual_micros})
    assert settled.status_code == 200, settled.text
    assert settled.json()["charged_micros"] == actual_micros


@pytest.mark.slow
def test_the_headline_counts_each_call_once(tree_service: Client) -> None:
    """A team's spend is its organisation's too: the headline adds the budgets at the top of each
    tree (none of whose ancestors has a budget), not a budget and its ancestors."""
    if shutil.which("chromium") is None:
        pytest.fail("chromium is missing: bash infra/setup.sh installs it")
    http = tree_service
    run = uuid.uuid4().hex[:8]
    org_a, org_b, org_c = (f"org:{name}{run}" for name in "abc")
    team_a = f"{org_a}/team:search"
    # org_b's team:x has no budget: its project's calls are charged to the project and org_b.
    project_b = f"{org_b}/team:x/project:y"
    # org_c has no budget of its own: its team is a top of the tree.
    team_c = f"{org_c}/team:z"
    for b in (org_a, team_a, org_b, project_b, team_c):
        http.budget(b, 100_000_000)
    charge(http, org_a, 1_000_000)
    charge(http, team_a, 200_000)
    charge(http, org_b, 50_000)
    charge(http, project_b, 300_000)
    charge(http, team_c, 70_000)

    def committed(budget_id: str) -> int:
        r = http.admin("GET", f"/v1/admin/budgets/{budget_id}")
        assert r.status_code == 200, r.text
        [total] = [p for p in r.json()["periods"] if p["period"] == "total"]
        return int(total["committed_micros"])

    roots = {b: committed(b) for b in (org_a, org_b, team_c)}
    assert roots == {org_a: 1_200_000, org_b: 350_000, team_c: 70_000}
    assert (committed(team_a), committed(project_b)) == (200_000, 300_000)
    spent = sum(roots.values())

    # What the route answers, before any browser.
    served = http.admin("GET", "/dashboard")
    assert served.status_code == 200
    assert HEADLINE.findall(served.text) == [usd(spent)]
    assert f"id=spent data-micros='{spent}'" in served.text

    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(extra_http_headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        page.goto(f"{http.base_url}/dashboard")
        headline = page.locator(".stat:has-text('spent in') b")
        assert headline.inner_text() == usd(spent)
        assert int(page.locator("#spent").get_attribute("data-micros") or -1) == spent
        # The nested budgets are still listed, each with its own spend.
        for b, micros in ((team_a, 200_000), (project_b, 300_000), *roots.items()):
            shown = page.locator(f"section.card[data-budget='{b}'] header [data-micros]")
            assert int(shown.get_attribute("data-micros") or -1) == micros, b
        browser.close()
