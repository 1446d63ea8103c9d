"""End users, rates and concurrency tried as a hostile key holder would, judged by the provider's
bill and the ledger's records in Redis.

A key holder names the end user of each call (X-Ceiling-User, or through the gateway OpenAI's
`safety_identifier` / `user` and Anthropic's `metadata.user_id`), so every user id is the
attacker's choice. Each attack below tries one way out:
- an id crafted to name another scope, budget, counter or hash tag, or no valid id at all (too
  long, empty, spaces, non-ASCII, not a string): a 4xx that changes nothing in Redis and sends
  nothing to the provider; ids that are valid but look like scopes (`user:bob`, `team:t`,
  `org:victim`, `..`) are each held in a counter of their own, and nothing else moves;
- the same id in two budgets, or the header against the body: each user spends in its own
  counters only, and the header decides who;
- thousands of user ids from one key: stopped at `users_max` (403 users_exhausted), with the
  Redis keys of the tag bounded by it and nothing forwarded for a refused call;
- `users_max` and a user's ceiling raced by concurrent calls across two instances: exactly
  `users_max` users admitted, and the provider's bill for the user within its ceiling;
- `required`: a call naming no user is 400 user_required and never forwarded;
- `rate`: the (N+1)-th request of a minute is 429 rate_limited and the (M+1)-th concurrent call
  429 concurrency_limited, both with Retry-After, both never forwarded, decided across two
  instances of one Redis.

Through two real gateway instances (ServiceProcess) on the session's Redis, in front of a fault
proxy (tests/api/conftest.py FaultProxy: a slow provider, so calls overlap) and the stub
provider, whose bill is the judge. Each attack prints one line (`-s`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from core.budgets import HASHED_USER_PREFIX, BudgetId
from core.ledger import LegStatus
from core.stores import keys
from core.stores.redis import RedisStore
from infra.processes import tls_context
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill
from tests.api.conftest import ADMIN_TOKEN, FaultProxy, as_key, gateway, per_user_budget
from tests.api.hostile import blocking, control, expire_held
from tests.support import write_prices

# As the other attack batteries: real gateway processes, outside the dev loop.
pytestmark = pytest.mark.slow

MODEL = "gpt-4o"
ANTHROPIC_MODEL = "claude-haiku-4-5"
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
# Every answer runs to its cap (the stub's mean is far above it): a call's bill is near its
# hold, ~1,030 micro-dollars for gpt-4o at the default tier.
OUTPUT_TOKENS_MEAN = 1_000_000
MAX_OUTPUT_TOKENS = 100
DEFAULT_TIER = {"service_tier": "default"}
HOSTILE_ENV = {"CEILING_EXPIRE_POLICY": "release"}
ANTHROPIC_VERSION = "2023-06-01"
# Far above what any attack here spends: only the limit under attack binds.
ROOMY_MICROS = 10_000_000
USER_CEILING_MICROS = 1_000_000
# A slow provider: calls made at once are all open together.
SLOW_PROVIDER_S = 1.5

# Ids a key holder could send to reach another scope, budget, counter or hash tag, or that are
# no id at all: each is refused (422) before anything is held.
CRAFTED_USER_IDS = (
    "x/team:y",  # a scope under the budget: '/' is the path's separator
    "../org:victim",  # a path out of it
    "/org:victim",
    "bob|total",  # a counter key's separator ('<budget>|<window>')
    "{org:victim}",  # another organisation's hash tag
    "a b",  # the separator between a reservation's legs
    "a" * 129,  # one past the longest
    "",  # empty
    "álice",  # not ASCII
    "bob\n",
)
# Ids that are valid (1-128 of A-Za-z0-9._:@-) but look like a scope, a budget or a path: each
# is a user of its own, '<budget>/user:<id>', and moves its own counter only.
LOOKALIKE_USER_IDS = (
    "user:bob", "bob:total", "team:t", "org:victim", "org:victim:user:bob", "..", ".", ":", "-",
    "BOB", "bob.", "bob@example.com", "a" * 128,
)
# What a JSON body may hold in a user field that is not an id (null is no user at all).
NOT_STRINGS: tuple[Any, ...] = (5, True, 1.5, ["bob"], {"id": "bob"})

# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """No overrides: every model at the bundled price, the stub at its own table's."""
    return write_prices(tmp_path_factory, "hostile_users", {"models": {}})


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=29, latency_ms_min=0, latency_ms_max=2,
                      output_tokens_mean=OUTPUT_TOKENS_MEAN) as provider:
        yield provider


def _gateway(redis_server: RedisServer, prices_file: str, proxy: FaultProxy) -> ServiceProcess:
    return gateway(redis_server, prices_file, f"{proxy.url}/v1", 30,
                   {**HOSTILE_ENV, "CEILING_ANTHROPIC_URL": proxy.url})


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, prices_file: str, proxy: FaultProxy
       ) -> Iterator[ServiceProcess]:
    with _gateway(redis_server, prices_file, proxy) as service:
        yield service


@pytest.fixture(scope="module")
def gw2(redis_server: RedisServer, prices_file: str, proxy: FaultProxy
        ) -> Iterator[ServiceProcess]:
    """A second instance on the same Redis: limits are decided by the ledger, not an
    instance."""
    with _gateway(redis_server, prices_file, proxy) as service:
        yield service


@pytest.fixture(scope="module")
def both(gw: ServiceProcess, gw2: ServiceProcess) -> tuple[ServiceProcess, ServiceProcess]:
    return gw, gw2


@pytest.fixture(autouse=True)
def fresh_provider(stub: StubProvider, proxy: FaultProxy) -> Iterator[None]:
    """Each attack is judged by its own bill, with a provider that answers at once."""
    control(stub, default_service_tier="default")
    reset_bill(stub.url)
    proxy.disarm()
    yield
    proxy.disarm()
    control(stub)


# -- accounts and calls --------------------------------------------------------------------------


def admin_call(service: ServiceProcess, method: str, path: str, body: Any = None
               ) -> httpx.Response:
    with httpx.Client(base_url=service.url, timeout=10.0, verify=tls_context()) as http:
        return http.request(method, path, json=body,
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})


def budget_with_users(service: ServiceProcess, tag: str, *, ceiling_micros: int = ROOMY_MICROS,
                      user_ceiling_micros: int = USER_CEILING_MICROS, users_max: int = 1_000,
                      required: bool = False, rate: dict[str, int] | None = None,
                      user_rate: dict[str, int] | None = None) -> None:
    body = per_user_budget(ceiling_micros, user_ceiling_micros, users_max, required, rate,
                           user_rate)
    r = admin_call(service, "PUT", f"/v1/admin/budgets/{tag}", body)
    assert r.status_code == 200, r.text


def new_key(service: ServiceProcess, budget_id: str) -> str:
    """A key with both roles, the most a key holder can be given."""
    r = admin_call(service, "POST", "/v1/admin/keys",
                   {"budget_id": budget_id, "roles": ["gateway", "sidecar"]})
    assert r.status_code == 201, r.text
    return str(r.json()["api_key"])


def new_tag() -> str:
    return f"org:u{uuid.uuid4().hex[:10]}"


# A route a user id can reach: its path, a body without a user, and where its body names one.
ROUTES: dict[str, tuple[str, dict[str, Any], tuple[tuple[str, ...], ...]]] = {
    "chat": ("/v1/chat/completions",
             {"model": MODEL, "messages": HELLO, "max_tokens": MAX_OUTPUT_TOKENS,
              **DEFAULT_TIER},
             (("user",), ("safety_identifier",))),
    "responses": ("/v1/responses",
                  {"model": MODEL, "input": "hello", "max_output_tokens": MAX_OUTPUT_TOKENS,
                   **DEFAULT_TIER},
                  (("user",), ("safety_identifier",))),
    "messages": ("/v1/messages",
                 {"model": ANTHROPIC_MODEL, "messages": HELLO, "max_tokens": MAX_OUTPUT_TOKENS},
                 (("metadata", "user_id"),)),
    "reserve": ("/v1/reservations", {"amount_micros": 10}, ()),
}


def request_of(route: str, key: str, *, header: str | bytes | None = None,
               field: tuple[str, ...] | None = None, value: Any = None,
               extra: dict[str, Any] | None = None) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A call on `route` for `key`: its path, headers and body; the user named by the header
    (raw bytes for a value that is not ASCII) and/or by `field` set to `value`."""
    path, base, _ = ROUTES[route]
    body: dict[str, Any] = json.loads(json.dumps(base))
    if field is not None:
        target = body
        for name in field[:-1]:
            target = target.setdefault(name, {})
        target[field[-1]] = value
    body.update(extra or {})
    headers: dict[str, Any] = (
        {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION} if route == "messages"
        else as_key(key))
    if header is not None:
        headers["X-Ceiling-User"] = header
    return path, headers, body


def send(service: ServiceProcess, call: tuple[str, dict[str, Any], dict[str, Any]]
         ) -> httpx.Response:
    path, headers, body = call
    with httpx.Client(base_url=service.url, timeout=30.0, verify=tls_context()) as http:
        return http.post(path, headers=headers, json=body)


async def send_all(calls: list[tuple[ServiceProcess, tuple[str, dict[str, Any], dict[str, Any]]]],
                   concurrency: int) -> list[httpx.Response]:
    """Every call, `concurrency` at a time (all at once when it is len(calls)), each to its
    instance; the answers in the calls' order."""
    gate = asyncio.Semaphore(concurrency)
    clients: dict[str, httpx.AsyncClient] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    for service, _ in calls:
        if service.url not in clients:
            clients[service.url] = httpx.AsyncClient(base_url=service.url, timeout=60.0,
                                                     verify=tls_context(), limits=limits)

    async def one(service: ServiceProcess, call: tuple[str, dict[str, Any], dict[str, Any]]
                  ) -> httpx.Response:
        path, headers, body = call
        async with gate:
            return await clients[service.url].post(path, headers=headers, json=body)

    try:
        return list(await asyncio.gather(*(one(s, c) for s, c in calls)))
    finally:
        for client in clients.values():
            await client.aclose()


def code_of(answer: httpx.Response) -> str:
    """The gateway's error code of an answer (either error shape), or its status."""
    try:
        doc = answer.json()
    except ValueError:
        return str(answer.status_code)
    error = doc.get("error") if isinstance(doc, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code or answer.status_code)


def outcomes(answers: list[httpx.Response]) -> Counter[str]:
    return Counter("ok" if a.status_code in (200, 201) else code_of(a) for a in answers)


# -- the ledger's records, read from Redis -------------------------------------------------------


def tag_keys(redis_url: str, tag: str) -> dict[str, Any]:
    """Every key of `tag` with its value, as Redis holds it (SCAN on the tag's prefix)."""
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        out: dict[str, Any] = {}
        for name in raw.scan_iter(match=f"{keys.prefix(tag)}*", count=1_000):
            kind = raw.type(name)
            if kind == "hash":
                out[name] = raw.hgetall(name)
            elif kind == "zset":
                out[name] = raw.zrange(name, 0, -1, withscores=True)
            elif kind == "set":
                out[name] = sorted(raw.smembers(name))
            elif kind == "string":
                out[name] = raw.get(name)
            else:
                out[name] = kind
        return out
    finally:
        raw.close()


def unchanged_state(redis_url: str, tag: str) -> dict[str, Any]:
    """What a refused call must not change: every key of the tag but its refusal counts, which
    count refusals by code (for /metrics) by design."""
    found = tag_keys(redis_url, tag)
    found.pop(keys.refused(tag), None)
    return found


def counters(redis_url: str, tag: str) -> dict[str, int]:
    """Each budget's committed spend in `tag`, by counter key, once nothing is held."""
    out = {}
    for name, value in tag_keys(redis_url, tag).items():
        if name.startswith(keys.prefix(tag) + keys.COUNTER):
            assert int(value.get("reserved", 0)) == 0, f"{name} still holds money"
            out[name] = int(value.get("committed", 0))
    return out


async def _user_leg(redis_url: str, tag: str, user: str) -> LegStatus:
    store = RedisStore(redis_url)
    try:
        legs = await store.status((BudgetId(tag),), None, user)
    finally:
        await store.close()
    (leg,) = [x for x in legs if x.budget_id == f"{tag}/user:{user}"]
    return leg


def users_of(service: ServiceProcess, budget_id: str) -> list[str]:
    """The end users the ledger keeps for `budget_id` (one page: these tests make fewer)."""
    r = admin_call(service, "GET", f"/v1/admin/budgets/{budget_id}/users?limit=1000")
    assert r.status_code == 200, r.text
    return [u["user"] for u in r.json()["users"]]


def user_leg(redis_server: RedisServer, tag: str, user: str) -> LegStatus:
    """The end user's `total` leg, after the ledger's expiry has resolved every hold of the tag."""
    blocking(expire_held(redis_server.url, tag))
    return blocking(_user_leg(redis_server.url, tag, user))


def user_counter(tag: str, user: str, budget_id: str | None = None) -> str:
    """The `total` counter of `user` of `budget_id` (the tag's own budget by default)."""
    return keys.counter(tag, f"{budget_id or tag}/user:{user}", "total")


def report(vector: str, calls: int, answers: Counter[str], billed_calls: int, billed: int,
           ceiling: int | str) -> None:
    print(f"\nhostile | users: {vector} | calls {calls}, provider billed {billed_calls} | "
          f"ceiling {ceiling} | billed {billed} | answers {dict(answers)}")


# -- a: ids crafted to reach another scope, budget or counter ------------------------------------


def test_crafted_user_ids_are_refused_by_header_and_hashed_from_a_body(
    both: tuple[ServiceProcess, ServiceProcess], stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """Every crafted id by header on each route (the sidecar's reserve too): a 4xx naming the
    user field, on both instances, nothing reaching the provider. By each body field of each
    gateway route, and every body field holding something that is not a string: the provider
    takes any value there, so the value names its user by its digest (`sha256:...`), which no
    path, separator or hash tag survives. No key of the victim's organisation changes, and every
    user the attacker's calls made is a digest, each settled to what the stub billed in all."""
    gw, gw2 = both
    tag, victim = new_tag(), new_tag()
    budget_with_users(gw, tag)
    budget_with_users(gw, victim)
    key = new_key(gw, tag)
    # Both organisations have a user 'bob' who has spent, so the crafted ids have counters to
    # aim at.
    for org in (tag, victim):
        assert send(gw, request_of("chat", new_key(gw, org), header="bob")).status_code == 200
    reset_bill(stub.url)
    before_victim = unchanged_state(redis_server.url, victim)
    before_bob = user_leg(redis_server, tag, "bob")

    by_header, by_body = [], []
    for user in CRAFTED_USER_IDS:
        header: str | bytes = user if user.isascii() and "\n" not in user else user.encode()
        for route, (_, _, fields) in ROUTES.items():
            if "\n" not in user:  # not a header any HTTP client sends
                by_header.append(request_of(route, key, header=header))
            by_body += [request_of(route, key, field=f, value=user) for f in fields]
    for value in NOT_STRINGS:
        by_body += [request_of(route, key, field=f, value=value)
                    for route, (_, _, fields) in ROUTES.items() for f in fields]
    refused = [send((gw, gw2)[i % 2], call) for i, call in enumerate(by_header)]
    assert all(a.status_code == 422 and code_of(a) == "invalid_request" for a in refused), [
        (c[1].get("X-Ceiling-User"), a.text[:120])
        for c, a in zip(by_header, refused, strict=True) if a.status_code != 422]
    assert all("user" in a.text for a in refused)  # each names the user field it refused
    assert fetch_bill(stub.url).requests == 0, "a refused call reached the provider"

    hashed = [send((gw, gw2)[i % 2], call) for i, call in enumerate(by_body)]
    # Forwarded; what the provider refuses (Anthropic takes only a string user_id) is released.
    assert all(a.status_code == 200 or a.headers.get("x-ceiling-billing-outcome") == "released"
               for a in hashed), [a.text[:200] for a in hashed if a.status_code != 200]
    bill = fetch_bill(stub.url)
    report("crafted ids", len(by_header) + len(by_body), Counter(
        code_of(a) for a in refused), bill.total.calls, bill.total.cost_micros, "-")
    assert unchanged_state(redis_server.url, victim) == before_victim
    assert user_leg(redis_server, tag, "bob") == before_bob
    made = [u for u in users_of(gw, tag) if u != "bob"]
    assert made
    assert all(u.startswith(HASHED_USER_PREFIX) for u in made), made
    assert sum(user_leg(redis_server, tag, u).committed_micros for u in made) == (
        bill.total.cost_micros)


def test_lookalike_ids_are_users_of_their_own(
    both: tuple[ServiceProcess, ServiceProcess], stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """Valid ids shaped like scopes, budgets and paths, one call each (header and body fields,
    alternating, on both instances): each is held as '<budget>/user:<id>' and charged there
    exactly what the provider billed its call; bob, the team budget beside them and the
    victim organisation do not move, and no other counter appears."""
    gw, gw2 = both
    tag, victim = new_tag(), new_tag()
    team = f"{tag}/team:t"
    budget_with_users(gw, tag)
    budget_with_users(gw, team)
    budget_with_users(gw, victim)
    key = new_key(gw, tag)
    for org, budget in ((tag, tag), (tag, team), (victim, victim)):
        answer = send(gw, request_of("chat", new_key(gw, budget), header="bob"))
        assert answer.status_code == 200, answer.text
        blocking(expire_held(redis_server.url, org))
    reset_bill(stub.url)
    before = {t: counters(redis_server.url, t) for t in (tag, victim)}

    # The header, then each body field, in turn (None: the header).
    ways: list[tuple[str, ...] | None] = [None, ("user",), ("safety_identifier",)]
    answers = []
    for i, user in enumerate(LOOKALIKE_USER_IDS):  # one after another: the bill's log is in order
        field = ways[i % len(ways)]
        call = (request_of("chat", key, header=user) if field is None
                else request_of("chat", key, field=field, value=user))
        answers.append(send((gw, gw2)[i % 2], call))
    assert [a.status_code for a in answers] == [200] * len(LOOKALIKE_USER_IDS), [
        a.text[:200] for a in answers if a.status_code != 200]

    blocking(expire_held(redis_server.url, tag))
    bill = fetch_bill(stub.url)
    report("lookalike ids", len(answers), outcomes(answers), bill.total.calls,
           bill.total.cost_micros, USER_CEILING_MICROS)
    after = {t: counters(redis_server.url, t) for t in (tag, victim)}
    assert after[victim] == before[victim]
    billed_by_user = {user: c.cost_micros
                      for user, c in zip(LOOKALIKE_USER_IDS, bill.log, strict=True)}
    assert all(billed_by_user.values())
    org_total = keys.counter(tag, tag, "total")
    moved = {name: after[tag].get(name, 0) - before[tag].get(name, 0)
             for name in after[tag].keys() | before[tag].keys()}
    # Each lookalike's own counter holds its call's bill, to the micro-dollar; the org moved by
    # their sum; nothing else moved (bob's, the team's and the team's bob's counters included).
    assert {name: d for name, d in moved.items() if d} == {
        org_total: bill.total.cost_micros,
        **{user_counter(tag, user): billed for user, billed in billed_by_user.items()}}
    assert {user_counter(tag, "bob"), keys.counter(tag, team, "total"),
            user_counter(tag, "bob", team)} <= before[tag].keys()
    for answer, user in zip(answers, LOOKALIKE_USER_IDS, strict=True):
        assert int(answer.headers["x-ceiling-user-remaining-micros"]) == (
            USER_CEILING_MICROS - billed_by_user[user])


def test_the_header_wins_over_the_body_and_safety_identifier_over_user(
    both: tuple[ServiceProcess, ServiceProcess], stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """Who a call is charged to, when a request names several users: the header, else
    `safety_identifier`, else `user` (Messages: the header, else `metadata.user_id`). One call
    each; only the winner's counter moves, by what the provider billed it."""
    gw, gw2 = both
    tag = new_tag()
    budget_with_users(gw, tag)
    key = new_key(gw, tag)
    cases = [
        ("carol", request_of("chat", key, header="carol",
                             extra={"user": "alice", "safety_identifier": "dave"})),
        ("dave", request_of("chat", key, extra={"user": "alice", "safety_identifier": "dave"})),
        ("erin", request_of("responses", key, header="erin", extra={"user": "alice"})),
        ("frank", request_of("messages", key, header="frank", field=("metadata", "user_id"),
                             value="alice")),
        ("alice", request_of("messages", key, field=("metadata", "user_id"), value="alice")),
    ]
    answers = [send((gw, gw2)[i % 2], call) for i, (_, call) in enumerate(cases)]
    assert [a.status_code for a in answers] == [200] * len(cases), [a.text for a in answers]
    blocking(expire_held(redis_server.url, tag))
    bill = fetch_bill(stub.url)
    report("header against body", len(cases), outcomes(answers), bill.total.calls,
           bill.total.cost_micros, USER_CEILING_MICROS)
    found = counters(redis_server.url, tag)
    users = {name: committed for name, committed in found.items() if "/user:" in name}
    assert users == {user_counter(tag, user): c.cost_micros
                     for (user, _), c in zip(cases, bill.log, strict=True)}


def test_a_body_user_that_is_no_id_beside_a_valid_header_is_forwarded_under_the_header(
    gw: ServiceProcess, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """The header names the user; the body's own user field is not an id. The header wins: the
    call is held against the header's user, and the body is forwarded as it is."""
    tag = new_tag()
    budget_with_users(gw, tag)
    key = new_key(gw, tag)
    answers = [send(gw, request_of("chat", key, header="bob", field=("user",), value=value))
               for value in (5, "a" * 129, "x/team:y")]
    assert [a.status_code for a in answers] == [200] * len(answers)
    assert user_leg(redis_server, tag, "bob").committed_micros == (
        fetch_bill(stub.url).total.cost_micros)
    assert users_of(gw, tag) == ["bob"]


def test_one_id_in_two_budgets_is_two_users(
    both: tuple[ServiceProcess, ServiceProcess], stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """A user spends its ceiling in one organisation until refused; the same id in another
    organisation still has all of its own room, and spending there leaves the first as it
    was."""
    gw, gw2 = both
    ceiling = 3_500  # three calls' holds
    first, second = new_tag(), new_tag()
    for org in (first, second):
        budget_with_users(gw, org, user_ceiling_micros=ceiling)
    user = "shared@example.com"
    key = new_key(gw, first)
    answers = [send((gw, gw2)[i % 2], request_of("chat", key, header=user)) for i in range(6)]
    assert outcomes(answers)["budget_exceeded"] > 0
    refusal = next(a for a in answers if code_of(a) == "budget_exceeded")
    assert refusal.status_code == 402
    assert refusal.json()["error"]["budget_id"] == f"{first}/user:{user}"
    spent_first = user_leg(redis_server, first, user)
    bill = fetch_bill(stub.url)
    assert bill.total.cost_micros <= ceiling
    assert spent_first.committed_micros == bill.total.cost_micros

    reset_bill(stub.url)
    answer = send(gw2, request_of("chat", new_key(gw, second), field=("user",), value=user))
    assert answer.status_code == 200, answer.text
    billed = fetch_bill(stub.url).total.cost_micros
    assert int(answer.headers["x-ceiling-user-remaining-micros"]) == ceiling - billed
    assert user_leg(redis_server, second, user).committed_micros == billed
    assert user_leg(redis_server, first, user) == spent_first
    report("one id, two budgets", len(answers) + 1, outcomes([*answers, answer]),
           bill.total.calls + 1, bill.total.cost_micros + billed, ceiling)


# -- b, c: growing state, and users_max raced ----------------------------------------------------

MINTED_USERS = 1_000
USERS_MAX = 50
# Keys one admitted user may leave in the tag: its total counter and its rate log (a per-user
# rate), besides its call's reservation record (kept for the resend window).
KEYS_PER_USER_MAX = 3
# The tag's own keys whatever its users: meta, definition, total counter, users set, open
# leases, refusal counts, quota, alert keys.
KEYS_OF_A_TAG_MAX = 12


def test_a_key_minting_user_ids_is_stopped_at_users_max(
    both: tuple[ServiceProcess, ServiceProcess], stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """2,000 calls, each for a user id never seen before (header and body alternating), 32 at a
    time across two instances: exactly users_max are admitted and forwarded, every other call
    is 403 users_exhausted and never reaches the provider, and the keys the tag holds in Redis
    are bounded by users_max, not by the ids minted. The users admitted keep being served."""
    gw, gw2 = both
    tag = new_tag()
    budget_with_users(gw, tag, users_max=USERS_MAX,
                      user_rate={"requests_per_minute": 1_000, "concurrent_max": 10})
    key = new_key(gw, tag)
    keys_before = len(tag_keys(redis_server.url, tag))
    calls = [((gw, gw2)[i % 2],
              request_of("chat", key, header=f"mint-{i}") if i % 2
              else request_of("chat", key, field=("user",), value=f"mint-{i}"))
             for i in range(MINTED_USERS)]
    answers = asyncio.run(send_all(calls, concurrency=32))
    found = outcomes(answers)
    blocking(expire_held(redis_server.url, tag))
    bill = fetch_bill(stub.url)
    held = tag_keys(redis_server.url, tag)
    kinds = Counter(name.removeprefix(keys.prefix(tag)).split(":", 1)[0].split("|", 1)[0]
                    for name in held)
    report("minting user ids", len(calls), found, bill.total.calls, bill.total.cost_micros,
           f"users_max {USERS_MAX}")
    print(f"hostile | users: keys of the tag before {keys_before}, after {len(held)}: "
          f"{dict(kinds)}")

    assert found == {"ok": USERS_MAX, "users_exhausted": MINTED_USERS - USERS_MAX}, found
    refused = [a for a in answers if a.status_code != 200]
    assert {a.status_code for a in refused} == {403}
    assert all("x-ceiling-reservation-id" not in a.headers for a in refused)
    assert bill.requests == bill.total.calls == USERS_MAX, "a refused call reached the provider"
    users = sorted(u for u, _ in held[f"{keys.prefix(tag)}{keys.USERS}{tag}"])
    admitted = sorted(f"mint-{i}" for i, a in enumerate(answers) if a.status_code == 200)
    assert users == admitted
    user_counters = [n for n in held
                     if n.startswith(f"{keys.prefix(tag)}{keys.COUNTER}{tag}/user:")]
    assert len(user_counters) == USERS_MAX
    assert len(held) <= KEYS_OF_A_TAG_MAX + KEYS_PER_USER_MAX * USERS_MAX, dict(kinds)
    # Those admitted are still served; a new one still is not.
    again = [send(gw2, request_of("chat", key, header=admitted[0])),
             send(gw, request_of("chat", key, header="mint-new"))]
    assert [a.status_code for a in again] == [200, 403]


@pytest.mark.parametrize("way", ["header", "body"])
def test_users_max_is_not_escaped_by_new_users_at_once(
    both: tuple[ServiceProcess, ServiceProcess], stub: StubProvider,
    redis_server: RedisServer, way: str,
) -> None:
    """40 new users' calls sent at once across two instances against users_max 5: exactly 5
    admitted and billed, 35 users_exhausted."""
    gw, gw2 = both
    tag = new_tag()
    users_max, racing = 5, 40
    budget_with_users(gw, tag, users_max=users_max)
    key = new_key(gw, tag)
    calls = [((gw, gw2)[i % 2],
              request_of("chat", key, header=f"racer-{i}") if way == "header"
              else request_of("chat", key, field=("safety_identifier",), value=f"racer-{i}"))
             for i in range(racing)]
    answers = asyncio.run(send_all(calls, concurrency=racing))
    found = outcomes(answers)
    blocking(expire_held(redis_server.url, tag))
    bill = fetch_bill(stub.url)
    report(f"users_max raced ({way})", racing, found, bill.total.calls, bill.total.cost_micros,
           f"users_max {users_max}")
    assert found == {"ok": users_max, "users_exhausted": racing - users_max}
    assert bill.requests == bill.total.calls == users_max
    held = tag_keys(redis_server.url, tag)
    assert len(held[f"{keys.prefix(tag)}{keys.USERS}{tag}"]) == users_max


# -- d: a user's ceiling raced -------------------------------------------------------------------


def test_a_users_ceiling_is_not_escaped_by_concurrent_calls(
    both: tuple[ServiceProcess, ServiceProcess], proxy: FaultProxy, stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """Rounds of 12 calls at once for one user, across two instances, against a slow provider
    (every call of a round is open at once), under a budget with far more room: the provider's
    bill for the user stays within the user's ceiling, the ledger committed it to the
    micro-dollar, and the refusals name the user's budget."""
    gw, gw2 = both
    tag = new_tag()
    ceiling = 3_500  # three calls' holds, ~1,030 each
    budget_with_users(gw, tag, user_ceiling_micros=ceiling)
    key = new_key(gw, tag)
    proxy.delay_s = 0.3
    answers: list[httpx.Response] = []
    for round_ in range(3):
        calls = [((gw, gw2)[i % 2],
                  request_of("chat", key, header="victim") if (i + round_) % 2
                  else request_of("chat", key, field=("user",), value="victim"))
                 for i in range(12)]
        answers += asyncio.run(send_all(calls, concurrency=len(calls)))
    leg = user_leg(redis_server, tag, "victim")
    bill = fetch_bill(stub.url)
    found = outcomes(answers)
    report("a user's ceiling raced", len(answers), found, bill.total.calls,
           bill.total.cost_micros, ceiling)
    assert 0 < bill.total.cost_micros <= ceiling, "the provider's bill passed the user's ceiling"
    assert (leg.committed_micros, leg.reserved_micros) == (bill.total.cost_micros, 0)
    assert found["ok"] == bill.total.calls == bill.requests
    assert set(found) <= {"ok", "budget_busy", "budget_exceeded"}, found
    assert found["budget_exceeded"] > 0
    refusals = [a.json()["error"] for a in answers if a.status_code != 200]
    assert {e["budget_id"] for e in refusals} == {f"{tag}/user:victim"}


# -- e: required -----------------------------------------------------------------------------------


def test_a_call_naming_no_user_is_refused_when_one_is_required(
    both: tuple[ServiceProcess, ServiceProcess], stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """Every route, with no user at all, a user field of null, an empty metadata: 400
    user_required, never forwarded, nothing changed. The same call naming a user passes."""
    gw, gw2 = both
    tag = new_tag()
    budget_with_users(gw, tag, required=True)
    key = new_key(gw, tag)
    before = unchanged_state(redis_server.url, tag)
    calls = [request_of(route, key) for route in ROUTES]
    calls += [request_of(route, key, field=f, value=None)
              for route, (_, _, fields) in ROUTES.items() for f in fields]
    calls.append(request_of("messages", key, extra={"metadata": {}}))
    answers = [send((gw, gw2)[i % 2], call) for i, call in enumerate(calls)]
    bill = fetch_bill(stub.url)
    report("required, no user", len(calls), outcomes(answers), bill.total.calls,
           bill.total.cost_micros, "-")
    assert [(a.status_code, code_of(a)) for a in answers] == (
        [(400, "user_required")] * len(calls)), [a.text[:200] for a in answers]
    assert bill.requests == 0
    assert unchanged_state(redis_server.url, tag) == before
    answer = send(gw2, request_of("chat", key, header="named"))
    assert answer.status_code == 200, answer.text
    assert fetch_bill(stub.url).total.calls == 1


# -- f: rates and concurrency, across two instances ------------------------------------------------

REQUESTS_PER_MINUTE = 5
CONCURRENT_MAX = 3


def limited_budget(gw: ServiceProcess, tag: str, scope: str, rate: dict[str, int]) -> None:
    if scope == "budget":
        budget_with_users(gw, tag, rate=rate)
    else:
        budget_with_users(gw, tag, user_rate=rate)


@pytest.mark.parametrize("scope", ["budget", "user"])
def test_the_request_past_the_rate_is_refused_and_not_forwarded(
    both: tuple[ServiceProcess, ServiceProcess], stub: StubProvider, scope: str,
) -> None:
    """requests_per_minute 5 on the budget, or on each of its users: 5 calls alternating
    between two instances pass; the 6th on either is 429 rate_limited with a Retry-After within
    the minute, naming the limited budget, and is not forwarded. A user's rate is its own."""
    gw, gw2 = both
    tag = new_tag()
    limited_budget(gw, tag, scope, {"requests_per_minute": REQUESTS_PER_MINUTE})
    key = new_key(gw, tag)
    answers = [send((gw, gw2)[i % 2], request_of("chat", key, header="rater"))
               for i in range(REQUESTS_PER_MINUTE)]
    assert [a.status_code for a in answers] == [200] * REQUESTS_PER_MINUTE
    refused = [send(service, request_of(route, key, header="rater"))
               for service in (gw, gw2) for route in ("chat", "messages")]
    other = send(gw2, request_of("chat", key, header="another"))
    bill = fetch_bill(stub.url)
    report(f"rate on the {scope}", len(answers) + len(refused) + 1,
           outcomes([*answers, *refused, other]), bill.total.calls, bill.total.cost_micros, "-")
    limited = tag if scope == "budget" else f"{tag}/user:rater"
    for answer in refused:
        assert (answer.status_code, code_of(answer)) == (429, "rate_limited"), answer.text
        assert 1 <= int(answer.headers["retry-after"]) <= 60
        assert answer.json()["error"]["budget_id"] == limited
        assert "x-should-retry" not in answer.headers  # retryable, unlike budget_exceeded
    if scope == "budget":
        assert code_of(other) == "rate_limited"
        assert bill.requests == REQUESTS_PER_MINUTE
    else:
        assert other.status_code == 200, other.text
        assert bill.requests == REQUESTS_PER_MINUTE + 1


@pytest.mark.parametrize("scope", ["budget", "user"])
def test_the_call_past_concurrent_max_is_refused_and_not_forwarded(
    both: tuple[ServiceProcess, ServiceProcess], proxy: FaultProxy, stub: StubProvider,
    redis_server: RedisServer, scope: str,
) -> None:
    """concurrent_max 3 on the budget, or on each of its users, against a provider that takes
    a second to answer: of 6 calls for one user sent at once across two instances exactly 3 are
    admitted and forwarded, 3 are 429 concurrency_limited with Retry-After. Once they end their
    slots are free again."""
    gw, gw2 = both
    tag = new_tag()
    limited_budget(gw, tag, scope, {"concurrent_max": CONCURRENT_MAX})
    key = new_key(gw, tag)
    proxy.delay_s = SLOW_PROVIDER_S
    racing = 2 * CONCURRENT_MAX
    calls = [((gw, gw2)[i % 2], request_of("chat", key, header="busy-user"))
             for i in range(racing)]
    answers = asyncio.run(send_all(calls, concurrency=racing))
    found = outcomes(answers)
    bill = fetch_bill(stub.url)
    report(f"concurrency on the {scope}", racing, found, bill.total.calls,
           bill.total.cost_micros, "-")
    assert found == {"ok": CONCURRENT_MAX, "concurrency_limited": racing - CONCURRENT_MAX}
    assert bill.requests == CONCURRENT_MAX
    limited = tag if scope == "budget" else f"{tag}/user:busy-user"
    for answer in answers:
        if answer.status_code != 200:
            assert answer.status_code == 429
            assert int(answer.headers["retry-after"]) >= 1
            assert answer.json()["error"]["budget_id"] == limited
    # The admitted calls have settled: their slots are free again (no expiry needed).
    proxy.disarm()
    again = asyncio.run(send_all(
        [((gw, gw2)[i % 2], request_of("chat", key, header="busy-user"))
         for i in range(CONCURRENT_MAX)], concurrency=CONCURRENT_MAX))
    assert [a.status_code for a in again] == [200] * CONCURRENT_MAX
