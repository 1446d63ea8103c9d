"""GET /dashboard: the spend page, server-rendered HTML for operators.

No script at all, no build step, nothing from another host: the charts are inline SVG drawn
here, the style one <style> element allowed by a per-response nonce, and the Content-Security-
Policy says so (`default-src 'none'`), so markup that got into a budget id (escaped anyway)
could not run. Access: the admin token as a bearer header, or the sign-in form, which sets an
HttpOnly, SameSite=Strict cookie (Secure over https) holding a signed expiry, never the token.
The sign-in and sign-out forms are the only requests that change anything, and they are refused
from another origin.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Sequence
from decimal import Decimal
from html import escape
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from api.auth import bearer
from api.routing import HotRoute, header_of
from api.runtime import admin_token, is_admin_token, runtime
from api.views import made_by
from core import spend
from core.alerts import AlertEvent
from core.budgets import RUN_SCOPE_KIND, period_of
from core.ledger import LegStatus, OpenHold, RunSpend
from core.limits import SPEND_BUCKET_MS
from core.text import whole_number

COOKIE = "ceiling_session"
# A sign-in lasts a working day; the cookie's own signed expiry enforces it, not the browser.
SESSION_S = 12 * 3600
# Digits of a session's expiry (seconds since 1970): ten until the year 2286.
SESSION_EXPIRY_DIGITS_MAX = 11
# The sign-in form's body: a token is far shorter.
SIGN_IN_BYTES_MAX = 4096
CHART_WIDTH, CHART_HEIGHT = 560, 120


def _session_mac(token: str, expires_s: int) -> str:
    return hmac.new(token.encode(), f"dashboard-session:{expires_s}".encode(),
                    hashlib.sha256).hexdigest()


def session_cookie(token: str, now_s: int) -> str:
    expires_s = now_s + SESSION_S
    return f"v1.{expires_s}.{_session_mac(token, expires_s)}"


def session_valid(token: str, cookie: str | None, now_s: int) -> bool:
    if not cookie:
        return False
    parts = cookie.split(".")
    expires_s = whole_number(parts[1], SESSION_EXPIRY_DIGITS_MAX) if len(parts) == 3 else None
    if parts[0] != "v1" or expires_s is None:
        return False
    return expires_s > now_s and hmac.compare_digest(parts[2], _session_mac(token, expires_s))


def _signed_in(request: Request) -> bool:
    token = admin_token()
    if not token:
        return False
    given = bearer(header_of(request, b"authorization"))
    if given is not None:
        return is_admin_token(given)
    return session_valid(token, request.cookies.get(COOKIE), int(time.time()))


def _page(body: str, status: int = 200, title: str = "spend-ceiling") -> HTMLResponse:
    nonce = secrets.token_urlsafe(16)
    html = (f"<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<meta name=viewport content='width=device-width,initial-scale=1'>"
            f"<title>{escape(title)}</title><style nonce=\"{nonce}\">{CSS}</style></head>"
            f"<body>{body}</body></html>")
    csp = (f"default-src 'none'; style-src 'nonce-{nonce}'; img-src 'self' data:; "
           "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
    return HTMLResponse(html, status_code=status, headers={
        "content-security-policy": csp, "x-content-type-options": "nosniff",
        "referrer-policy": "same-origin", "cache-control": "no-store",
        "x-frame-options": "DENY"})


def _sign_in_page(message: str = "", status: int = 401) -> HTMLResponse:
    closed = not admin_token()
    note = ("<p class=warn>Admin routes are closed: CEILING_ADMIN_TOKEN is not set.</p>"
            if closed else "")
    error = f"<p class=warn role=alert>{escape(message)}</p>" if message else ""
    return _page(
        "<main class=signin><h1>spend-ceiling</h1><p class=muted>Sign in with the admin token "
        f"to see where the money goes.</p>{note}{error}"
        "<form method=post action='/dashboard/sign-in'>"
        "<label for=token>Admin token</label>"
        "<input id=token name=token type=password autocomplete=current-password required>"
        "<button type=submit>Sign in</button></form></main>", status, "Sign in · spend-ceiling")


def _https(request: Request) -> bool:
    """Whether the browser reached us over https: directly, or through a proxy that terminated
    TLS and says so (Vercel, a load balancer). A forged header only makes the cookie stricter."""
    return (request.url.scheme == "https"
            or request.headers.get("x-forwarded-proto", "").lower() == "https")


def _same_origin(request: Request) -> bool:
    """A form post from this host, or from no page at all (curl): never from another origin."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    host = request.headers.get("host", "")
    return origin.split("://", 1)[-1] == host


async def dashboard(request: Request) -> Response:
    if not _signed_in(request):
        return _sign_in_page(status=401)
    rt = runtime()
    hours = spend.check_hours(request.query_params.get("hours"))
    view = await spend.overview(rt.store(), rt.instance_id, hours, rt.operations().catalogue)
    return _page(render(view))


async def sign_in(request: Request) -> Response:
    if not _same_origin(request):
        return _sign_in_page("Sign-in is accepted from this page only.", 403)
    raw = await request.body()
    if len(raw) > SIGN_IN_BYTES_MAX:
        return _sign_in_page("That is not an admin token.", 401)
    given = (parse_qs(raw.decode("utf-8", "replace")).get("token") or [""])[0]
    token = admin_token()
    if not token or not is_admin_token(given):
        return _sign_in_page("That is not the admin token.", 401)
    answer = RedirectResponse("/dashboard", status_code=303)
    answer.set_cookie(COOKIE, session_cookie(token, int(time.time())), max_age=SESSION_S,
                      path="/dashboard", httponly=True, samesite="strict",
                      secure=_https(request))
    return answer


async def sign_out(request: Request) -> Response:
    if not _same_origin(request):
        return _sign_in_page("Sign-out is accepted from this page only.", 403)
    answer = RedirectResponse("/dashboard", status_code=303)
    answer.delete_cookie(COOKIE, path="/dashboard", httponly=True, samesite="strict",
                         secure=_https(request))
    return answer


# The HTML pages are no part of the API's document.
ROUTES = (
    HotRoute("/dashboard", dashboard, ("GET",), keyed=False, in_schema=False),
    HotRoute("/dashboard/sign-in", sign_in, keyed=False, in_schema=False),
    HotRoute("/dashboard/sign-out", sign_out, keyed=False, in_schema=False),
)


# -- rendering ----------------------------------------------------------------------------------


def usd(micros: int) -> str:
    sign = "-" if micros < 0 else ""
    value = Decimal(abs(micros)) / 1_000_000
    # cents once there are cents; below a cent, the four places a single cheap call needs
    places = 2 if abs(micros) >= 10_000 or micros == 0 else 4
    return f"{sign}${value:,.{places}f}"


def _when(ms: int | None) -> str:
    if not ms:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ms / 1000))


def _attr(value: object) -> str:
    return escape(str(value), quote=True)


def _bar(leg: LegStatus) -> str:
    """How much of a period's ceiling is spent (committed) and held (reserved)."""
    ceiling = max(leg.ceiling_micros, 1)
    spent = min(1.0, leg.committed_micros / ceiling)
    held = min(1.0 - spent, leg.reserved_micros / ceiling)
    tone = "over" if spent >= 1 else "high" if spent >= 0.8 else "ok"
    return (f"<svg class=bar viewBox='0 0 100 8' preserveAspectRatio=none aria-hidden=true>"
            "<rect width='100' height='8' rx='4' fill='#e8ebf0'/>"
            f"<rect class='{tone}' width='{spent * 100:.2f}' height='8' rx='4'/>"
            f"<rect x='{spent * 100:.2f}' width='{held * 100:.2f}' height='8' fill='#f5b94a'/>"
            "</svg>")


def _money_cells(amounts: Sequence[tuple[str, int]], *, titled: bool = False) -> str:
    """A cell per (field, micros), in dollars, carrying the field's name and the exact amount
    (what a reader's tooltip, with `titled`, and the page's tests read)."""
    return "".join(
        f"<td class=num data-field='{name}' data-micros='{micros}'"
        + (f" title='{micros} micro-dollars'" if titled else "") + f">{usd(micros)}</td>"
        for name, micros in amounts)


def _period_rows(legs: Sequence[LegStatus], model: str | None = None) -> str:
    """A row per period window, with its figures and a bar of how much is spent; with `model`,
    the rows of a budget's calls of that model (per_model), which name it first."""
    named = "" if model is None else f"data-model='{_attr(model)}' "
    first = "" if model is None else f"<td><code>{escape(model)}</code></td>"
    rows = []
    for leg in legs:
        period = period_of(leg.window_key).value
        cells = _money_cells((("ceiling_micros", leg.ceiling_micros),
                              ("committed_micros", leg.committed_micros),
                              ("reserved_micros", leg.reserved_micros),
                              ("remaining_micros", leg.remaining_micros)), titled=True)
        resets = "never" if leg.resets_at_ms is None else _when(leg.resets_at_ms)
        rows.append(f"<tr {named}data-period='{_attr(period)}' "
                    f"data-window='{_attr(leg.window_key)}'>{first}"
                    f"<th scope=row>{escape(period)}<small>{escape(leg.window_key)}</small></th>"
                    f"{cells}<td class=barcell>{_bar(leg)}<small>resets {resets}</small></td></tr>")
    return "".join(rows)


def chart(r: spend.BudgetReport, now_ms: int, hours: int) -> str:
    """Hourly spend as bars, oldest left: one bar per hour of the span that had spend."""
    last_hour = now_ms // SPEND_BUCKET_MS
    first_hour = last_hour - hours + 1
    top = max((p.committed_micros for p in r.series), default=0)
    slot = CHART_WIDTH / hours
    bars = []
    for p in r.series:
        h = max(0.0, p.committed_micros / top * (CHART_HEIGHT - 20)) if top > 0 else 0.0
        x = (p.hour_start_ms // SPEND_BUCKET_MS - first_hour) * slot
        bars.append(
            f"<rect class=pt x='{x:.1f}' y='{CHART_HEIGHT - 14 - h:.1f}' "
            f"width='{max(1.0, slot - 1):.1f}' height='{h:.1f}' "
            f"data-hour-ms='{p.hour_start_ms}' data-micros='{p.committed_micros}'>"
            f"<title>{_when(p.hour_start_ms)}: {usd(p.committed_micros)}</title></rect>")
    axis = (f"<line x1=0 y1='{CHART_HEIGHT - 14}' x2='{CHART_WIDTH}' y2='{CHART_HEIGHT - 14}' "
            "stroke='#c9ced6'/>"
            f"<text x=0 y='{CHART_HEIGHT - 2}'>{_when(first_hour * SPEND_BUCKET_MS)}</text>"
            f"<text x='{CHART_WIDTH}' y='{CHART_HEIGHT - 2}' text-anchor=end>now</text>"
            f"<text x=0 y=10>peak {usd(top)}/h</text>")
    empty = ("" if r.series else f"<text x='{CHART_WIDTH / 2}' y='{CHART_HEIGHT / 2}' "
             "text-anchor=middle class=muted>no spend in this span</text>")
    return (f"<svg class=chart viewBox='0 0 {CHART_WIDTH} {CHART_HEIGHT}' role=img "
            f"data-chart-for='{_attr(r.budget_id)}' aria-label='hourly spend of "
            f"{_attr(r.budget_id)}'>{axis}{empty}{''.join(bars)}</svg>")


def _models(r: spend.BudgetReport) -> str:
    """The models a budget's calls may name (models.allow) and each model of its per_model
    limits with its spend in its current windows: part of the budget's spend, not beside it."""
    if r.definition is None or (r.definition.models_allow is None and not r.models):
        return ""
    allow = r.definition.models_allow
    listed = ("<p class=muted data-models-allow='"
              + ("*" if allow is None else _attr(" ".join(allow))) + "'>models: "
              + ("any" if allow is None else ", ".join(f"<code>{escape(m)}</code>"
                                                      for m in allow)) + "</p>")
    rows = "".join(_period_rows(m.legs, m.model) for m in r.models)
    table = ("<table class=per-model><thead><tr><th>model</th><th>period</th><th>ceiling</th>"
             "<th>committed</th><th>reserved</th><th>remaining</th><th></th></tr></thead>"
             f"<tbody>{rows}</tbody></table>") if rows else ""
    return f"<div class=models>{listed}{table}</div>"


def _budget_card(r: spend.BudgetReport, now_ms: int, hours: int) -> str:
    paused = r.definition is not None and r.definition.paused_at_ms is not None
    badge = (f"<span class='badge over'>paused {escape(_when(r.definition.paused_at_ms))}"
             "</span>" if paused and r.definition else "")
    return (f"<section class=card data-budget='{_attr(r.budget_id)}'>"
            f"<header><h3>{escape(r.budget_id)}</h3>{badge}"
            f"<span class=muted data-micros='{r.series_micros}'>{usd(r.series_micros)} in "
            f"{hours} h</span></header>"
            "<table class=periods><thead><tr><th>period</th><th>ceiling</th><th>committed</th>"
            "<th>reserved</th><th>remaining</th><th></th></tr></thead>"
            f"<tbody>{_period_rows(r.legs)}</tbody></table>{_models(r)}{chart(r, now_ms, hours)}"
            "</section>")


def _list_table(table_id: str, heads: Sequence[str], rows: str) -> str:
    """One of the page's lists: a table of class `list` under `table_id`, its column heads
    (markup, given by this module), then `rows`."""
    head = "".join(f"<th>{h}</th>" for h in heads)
    return (f"<table class=list id={table_id}><thead><tr>{head}</tr></thead>"
            f"<tbody>{rows}</tbody></table>")


def _alert_rows(events: Sequence[AlertEvent]) -> str:
    if not events:
        return "<tr><td colspan=6 class=muted>No alerts yet.</td></tr>"
    rows = []
    for e in events:
        what = {"budget.threshold_crossed": f"{e.threshold_pct}% reached",
                "budget.exceeded": "refused: ceiling spent",
                "budget.velocity": "velocity alarm"}.get(e.type, e.type)
        rows.append(
            f"<tr data-event='{_attr(e.event_id)}'><td>{_when(e.at_ms)}</td>"
            f"<td>{escape(e.budget_id)}</td><td>{escape(e.period_key)}</td>"
            f"<td>{escape(what)}</td><td class=num>{usd(e.committed_micros)} / "
            f"{usd(e.ceiling_micros)}</td><td><span class='badge {_attr(e.state)}'>"
            f"{escape(e.state)}</span> <small>{e.attempts} attempt"
            f"{'' if e.attempts == 1 else 's'}</small></td></tr>")
    return "".join(rows)


def _duration(ms: int) -> str:
    """A span as a person reads it: '42 s', '3 m 20 s', '2 h 05 m', '1 d 3 h'."""
    s = max(0, ms) // 1000
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} m {s % 60:02d} s"
    if s < 86_400:
        return f"{s // 3600} h {s % 3600 // 60:02d} m"
    return f"{s // 86_400} d {s % 86_400 // 3600} h"


def _owner(owner: str) -> str:
    """The key a reservation was made under, and by which route (never a secret)."""
    key_id, route = made_by(owner)
    return f"{key_id} · {route.value}" if key_id else "—"


def _hold_row(h: OpenHold, now_ms: int) -> str:
    held_in = "".join(f"<span class=path>{escape(b)}</span>" for b in h.budget_ids)
    if h.run_budget_id:
        held_in += f"<span class=path>{escape(h.run_budget_id)} (run)</span>"
    age = "—" if h.created_ms is None else _duration(now_ms - h.created_ms)
    lease = (f"ended {_duration(now_ms - h.expires_at_ms)} ago" if h.expires_at_ms <= now_ms
             else f"ends in {_duration(h.expires_at_ms - now_ms)}")
    return (f"<tr data-reservation='{_attr(h.reservation_id)}' data-micros='{h.reserved_micros}'"
            f" data-expires-ms='{h.expires_at_ms}' data-owner='{_attr(h.owner)}'>"
            f"<td><code>{escape(h.reservation_id)}</code><small>{escape(_owner(h.owner))}</small>"
            f"</td><td>{held_in}</td><td class=num title='{h.reserved_micros} micro-dollars'>"
            f"{usd(h.reserved_micros)}</td>"
            f"<td class=num>{age}</td><td>{lease}<small>{_when(h.expires_at_ms)}</small></td></tr>")


def _holds_table(view: spend.Overview, overdue: bool) -> str:
    rows, unlisted = [], 0
    for t in view.leases:
        listed = t.overdue if overdue else t.within_lease
        count = t.overdue_count if overdue else t.open_count - t.overdue_count
        rows += [_hold_row(h, view.now_ms) for h in listed]
        unlisted += max(0, count - len(listed))
    if unlisted:
        rows.append(f"<tr class=more><td colspan=5 class=muted data-unlisted='{unlisted}'>"
                    f"{unlisted} more not listed: the {spend.RESERVATIONS_LISTED_MAX} earliest "
                    "lease ends of each organisation are.</td></tr>")
    none = "None past their lease." if overdue else "None open."
    return _list_table("overdue" if overdue else "open",
                       ("reservation · key", "held in", "held", "age", "lease"),
                       "".join(rows) or f"<tr><td colspan=5 class=muted>{none}</td></tr>")


def _leases(view: spend.Overview) -> str:
    counts = "".join(
        f"<tr data-tag='{_attr(t.tag)}'><td>{escape(t.tag)}</td><td class=num>{t.open_count}</td>"
        f"<td class=num>{t.overdue_count}</td></tr>" for t in view.leases if t.open_count
    ) or "<tr><td colspan=3 class=muted>None open.</td></tr>"
    return (
        "<h2>Open reservations</h2><p class=muted>Money held for calls in flight. A call's "
        "reservation holds its estimate in every budget on its path until it settles or is "
        "released. One past its lease has an unknown outcome: the caller never settled it, "
        "and it stays held in full until expiry books it by its policy (charged in full, or "
        "released). Listed: the "
        f"{spend.RESERVATIONS_LISTED_MAX} earliest lease ends of each kind per organisation; "
        "the rest are counted. Once expiry has charged a lease it is no longer open: its "
        "unknown outcome is kept for a correction (<code>ceiling reservations settle</code>), "
        "read by its id, not listed here.</p>"
        f"{_list_table('leases', ('organisation', 'open', 'past lease'), counts)}"
        f"<h3 class=sub>Past their lease (outcome unknown)</h3>{_holds_table(view, True)}"
        f"<h3 class=sub>Within their lease</h3>{_holds_table(view, False)}")


def _run_rows(runs: Sequence[RunSpend]) -> str:
    rows = []
    for r in runs:
        budget, _, run_id = r.budget_id.rpartition(f"/{RUN_SCOPE_KIND}:")
        cells = _money_cells((("committed_micros", r.committed_micros),
                              ("reserved_micros", r.reserved_micros),
                              ("ceiling_micros", r.ceiling_micros)))
        seen = "—" if r.seen_ms is None else _when(r.seen_ms)
        rows.append(f"<tr data-run='{_attr(r.budget_id)}'><td><code class=id>"
                    f"{escape(run_id)}</code></td><td>{escape(budget)}</td>{cells}"
                    f"<td>{seen}</td></tr>")
    return "".join(rows) or "<tr><td colspan=6 class=muted>No run has a call open.</td></tr>"


def _runs(view: spend.Overview) -> str:
    return (
        "<h2>Top runs</h2><p class=muted>Live runs: a run (<code>X-Ceiling-Run-Id</code>) with a "
        "call open now, found through the "
        f"{spend.RUNS_EXAMINED_MAX} open reservations with the latest lease ends in each "
        "organisation, ranked by committed "
        f"spend, {spend.TOP_RUNS_MAX} at most. A run between calls is not listed: the ledger "
        "keeps no index of runs, only a call's reservation leads to its run's counter. A run "
        "ends after a day without a call. The ceiling is the one its open call holds it to.</p>"
        + _list_table("runs", ("run", "budget", "committed", "reserved", "ceiling", "last call"),
                      _run_rows(view.top_runs)))


def _key_rows(found: Sequence[spend.BudgetKeys]) -> str:
    rows = []
    for b in found:
        for k in b.keys:
            run = "—" if k.run_ceiling_micros is None else usd(k.run_ceiling_micros)
            rows.append(
                f"<tr data-key='{_attr(k.key_id)}' data-budget='{_attr(b.budget_id)}'>"
                f"<td>{escape(b.budget_id)}</td><td><code>{escape(k.key_id)}</code></td>"
                f"<td>{escape(', '.join(k.roles))}</td><td class=num>{run}</td>"
                f"<td>{_when(k.last_used_ms)}</td></tr>")
        if not b.keys:
            rows.append(f"<tr><td>{escape(b.budget_id)}</td><td colspan=4 class=muted>"
                        "no key bound to it (its spend comes from keys of scopes below)</td></tr>")
        if b.more:
            rows.append(f"<tr class=more><td colspan=5 class=muted>more keys bound to "
                        f"{escape(b.budget_id)}: GET /v1/admin/keys?budget_id= lists them</td>"
                        "</tr>")
    return "".join(rows) or "<tr><td colspan=5 class=muted>No spend yet.</td></tr>"


def _keys(view: spend.Overview) -> str:
    intro = ("<h2>Keys of the top spenders</h2><p class=muted>Keys are not charged apart from "
             "their budgets: a key spends its budget's money, and its ancestors'. These are the "
             f"keys bound to each top spender ({spend.KEYS_LISTED_MAX} each at most), by id; "
             "the secret is never stored.</p>")
    if view.keys is None:
        return intro + "<p class=muted>The in-memory ledger keeps no list of keys.</p>"
    return intro + _list_table("keys", ("budget", "key", "roles", "run ceiling", "last used"),
                               _key_rows(view.keys))


def _user_rows(found: Sequence[spend.BudgetUsers]) -> str:
    rows = []
    for b in found:
        for u in b.top:
            leg = next(x for x in u.legs if x.period is b.period)
            cells = _money_cells((("committed_micros", leg.committed_micros),
                                  ("reserved_micros", leg.reserved_micros),
                                  ("remaining_micros", leg.remaining_micros),
                                  ("ceiling_micros", leg.ceiling_micros)))
            rows.append(
                f"<tr data-budget='{_attr(b.budget_id)}' data-user='{_attr(u.user)}' "
                f"data-user-budget='{_attr(u.budget_id)}'><td>{escape(b.budget_id)}</td>"
                f"<td><code class=id>{escape(u.user)}</code></td>"
                f"<td>{escape(b.period.value)}<small>{escape(leg.window_key)}</small></td>"
                f"{cells}</tr>")
        if not b.top:
            rows.append(f"<tr data-budget='{_attr(b.budget_id)}'><td>{escape(b.budget_id)}</td>"
                        f"<td colspan=6 class=muted>no end user has spent in this "
                        f"{escape(b.period.value)} yet</td></tr>")
        unread = None if b.users_count is None else b.users_count - b.examined
        if unread is None or unread > 0:
            more = ("its users were not read: the page reads "
                    f"{spend.USERS_EXAMINED_PAGE_MAX} in all" if unread is None else
                    f"{unread} more not read: the page reads the first {b.examined} by id")
            rows.append(f"<tr class=more><td colspan=7 class=muted data-unread='{unread or ''}'>"
                        f"{escape(b.budget_id)}: {more}; GET /v1/admin/budgets/"
                        f"{escape(b.budget_id)}/users lists them all</td></tr>")
    return "".join(rows) or (
        "<tr><td colspan=7 class=muted>No budget holds its end users (per_user).</td></tr>")


def _users(view: spend.Overview) -> str:
    return (
        "<h2>Top end users</h2><p class=muted>A budget with per_user limits holds each end user "
        "a call names to its own limits, as the budget <code>&lt;budget&gt;/user:&lt;id&gt;"
        "</code>; the call is charged to the budget as well, so a user's spend is part of its "
        "budget's, and neither the headline nor the budgets above count it again. Ranked by "
        "committed spend in the current window of the shortest period the per_user limits "
        f"have, {spend.TOP_USERS_MAX} per budget, among the first "
        f"{spend.USERS_EXAMINED_PER_BUDGET_MAX} users of each by id.</p>"
        + _list_table("top-users", ("budget", "end user", "period", "committed", "reserved",
                                    "remaining", "ceiling"), _user_rows(view.users)))


def tree_tops(budgets: Sequence[spend.BudgetReport]) -> tuple[spend.BudgetReport, ...]:
    """The budgets none of whose ancestors is among `budgets`: the tops of their trees.

    A call is charged to its key's budget and to every ancestor that has one, so a budget's
    spend already holds the spend of every budget under it; adding a budget to its ancestor
    counts the same call twice. The tops add up to each call once. Ancestors sort before their
    descendants, so the page's cut (PAGE_BUDGETS_MAX) never keeps a budget and drops a parent
    it has: a top here has no ancestor budget at all.
    """
    listed = {b.budget_id for b in budgets}
    return tuple(b for b in budgets
                 if not any(a in listed for a in _ancestors(b.budget_id)))


def _ancestors(budget_id: str) -> tuple[str, ...]:
    # By the path's text, not BudgetId: an id the page is given is shown even if malformed.
    scopes = budget_id.split("/")
    return tuple("/".join(scopes[:i]) for i in range(1, len(scopes)))


def render(view: spend.Overview) -> str:
    probe = view.probe
    status = "ok" if probe.reachable and probe.shared and not probe.reasons else "degraded"
    open_count = sum(t.open_count for t in view.leases)
    overdue = sum(t.overdue_count for t in view.leases)
    tops = tree_tops(view.budgets)
    total = sum(b.series_micros for b in tops)
    stats = (
        f"<div class=stat><b>{len(view.budgets)}</b><span>budgets</span></div>"
        f"<div class=stat id=spent data-micros='{total}' title='the spend of the {len(tops)} "
        f"budgets at the top of their trees, which holds the spend of the budgets under them'>"
        f"<b>{usd(total)}</b><span>spent in {view.hours} h</span></div>"
        f"<div class=stat><b>{open_count}</b><span>open reservations</span></div>"
        f"<div class=stat><b>{overdue}</b><span>past their lease (outcome unknown)</span></div>"
        f"<div class=stat><b>{len(view.alerts)}</b><span>alerts</span></div>")
    top = "".join(
        f"<tr><td>{escape(b.budget_id)}</td><td class=num>{usd(b.series_micros)}</td></tr>"
        for b in view.top_spenders) or "<tr><td colspan=2 class=muted>No spend yet.</td></tr>"
    reasons = ", ".join(probe.reasons) or "none"
    cards = "".join(_budget_card(b, view.now_ms, view.hours) for b in view.budgets) or (
        "<p class=muted>No budgets yet: PUT /v1/admin/budgets/{id} makes one.</p>")
    return (
        "<header class=top><h1>spend-ceiling</h1>"
        f"<span class='badge {status}' id=health>ledger {escape(status)}</span>"
        f"<span class=muted>{escape(probe.backend)} · {probe.instances_seen or 0} instances "
        f"seen · {_when(view.now_ms)}</span>"
        "<form method=post action='/dashboard/sign-out'><button class=link>Sign out</button>"
        "</form></header><main>"
        f"<div class=stats>{stats}</div>"
        f"<h2>Budgets</h2><div class=cards>{cards}</div>"
        "<div class=split><section><h2>Top spenders</h2><p class=muted>Each budget's spend "
        "holds the spend of the budgets under it: the rows overlap and do not add up to the "
        f"total.</p>{_list_table('top', ('budget', f'last {view.hours} h'), top)}"
        f"{_keys(view)}</section>"
        f"<section>{_runs(view)}"
        f"<h2>Health</h2><p>Ledger <b>{escape(probe.backend)}</b>, shared: "
        f"{'yes' if probe.shared else 'no'}, reachable: {'yes' if probe.reachable else 'no'}, "
        f"latency {probe.latency_ms if probe.latency_ms is not None else '—'} ms, "
        f"reasons: {escape(reasons)}.</p></section></div>"
        f"<section id=end-users>{_users(view)}</section>"
        f"<section id=reservations>{_leases(view)}</section>"
        "<h2>Alert log</h2>"
        + _list_table("alerts", ("when", "budget", "period", "what", "spent / ceiling",
                                 "delivery"), _alert_rows(view.alerts))
        + "</main>")


CSS = """
:root{--ink:#1d2430;--muted:#6b7482;--line:#e3e6eb;--bg:#f6f7f9;--ok:#2f9e6b;--high:#e08a1e;
--over:#d9463b;--card:#fff}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,
sans-serif;color:var(--ink);background:var(--bg)}
h1{font-size:18px;margin:0}h2{font-size:15px;margin:28px 0 10px}h3{font-size:14px;margin:0;
font-family:ui-monospace,SFMono-Regular,Menlo,monospace;word-break:break-all}
.top{display:flex;gap:14px;align-items:center;padding:14px 28px;background:var(--card);
border-bottom:1px solid var(--line)}.top form{margin-left:auto}
main{padding:8px 28px 40px;max-width:1280px}
.muted,small{color:var(--muted)}small{display:block;font-size:11px}
.badge{display:inline-block;padding:2px 8px;border-radius:10px;font-size:12px;font-weight:600;
background:#e8ebf0}.badge.ok,.badge.delivered{background:#dff3e9;color:#1e7a50}
.badge.degraded,.badge.pending{background:#fdf0d9;color:#8a5a0b}
.badge.over,.badge.failed{background:#fbe1de;color:#a3271d}
.stats{display:grid;grid-template-columns:repeat(auto-fit,minmax(170px,1fr));gap:12px;
margin-top:18px}.stat{background:var(--card);border:1px solid var(--line);border-radius:10px;
padding:14px 16px}.stat b{display:block;font-size:22px}.stat span{color:var(--muted)}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:14px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:14px 16px}
.card header{display:flex;gap:10px;align-items:baseline;margin-bottom:8px}
.card header .muted{margin-left:auto}
table{width:100%;border-collapse:collapse}th,td{text-align:left;padding:6px 8px;
border-bottom:1px solid var(--line);vertical-align:top}th{font-weight:600;color:var(--muted);
font-size:12px}td.num{text-align:right;font-variant-numeric:tabular-nums}
.periods th[scope=row],.per-model th[scope=row]{color:var(--ink);font-size:13px}
.barcell{width:28%}.models{margin-top:10px}.models p{margin:0 0 4px}
svg.bar{width:100%;height:8px;display:block;margin-top:5px}
svg.bar .ok{fill:var(--ok)}svg.bar .high{fill:var(--high)}svg.bar .over{fill:var(--over)}
svg.chart{width:100%;height:auto;margin-top:10px}svg.chart text{font-size:10px;fill:#6b7482}
svg.chart .pt{fill:#4a6cf7}svg.chart .pt:hover{fill:#2c48c4}
.list{background:var(--card);border:1px solid var(--line);border-radius:10px}
.split{display:grid;grid-template-columns:1fr 1fr;gap:24px}
button{font:inherit;padding:8px 14px;border-radius:8px;border:1px solid #3552d6;
background:#4a6cf7;color:#fff;cursor:pointer}button.link{background:none;border:none;
color:var(--muted);text-decoration:underline;padding:0}
.signin{max-width:360px;margin:12vh auto;background:var(--card);padding:28px;
border:1px solid var(--line);border-radius:12px}.signin label{display:block;margin:16px 0 6px;
font-weight:600}.signin input{width:100%;padding:9px 10px;border:1px solid #c9ced6;
border-radius:8px;font:inherit;margin-bottom:14px}.warn{color:#a3271d}
h3.sub{font-size:13px;margin:16px 0 8px;font-family:inherit}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;word-break:break-all}
code.id{white-space:nowrap;word-break:normal}
.path{display:block;font:12px ui-monospace,SFMono-Regular,Menlo,monospace;word-break:break-all}
@media (max-width:800px){.split{grid-template-columns:1fr}.cards{grid-template-columns:1fr}}
"""
