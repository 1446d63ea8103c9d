"""Parsers never 500: every hot route's body, headers and reservation id, fed what Hypothesis makes
of them, over real HTTP to a real instance in front of Redis and the stub provider.

The four gateway routes and the sidecar's (reserve, settle, release, the caller's budgets and
usage) get arbitrary JSON values, objects of random fields, bodies nested around and far past
core.jsonbody.JSON_DEPTH_MAX, bytes that are not UTF-8, numbers no int64 or float holds, top
levels that are not objects, duplicated keys, random header values and random reservation ids.
After every case: no 5xx came from the service (a provider's error relayed is the provider's); a
4xx the service answered itself left both fuzzed budgets as they were; a call it served (or
relayed the provider's answer to) left the ledger's invariant whole and the gateway's budget
holding at least what the stub billed.
"""

from __future__ import annotations

import enum
import json
import socket
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import BODY_BYTES_MAX
from api.models import ReserveBody, SettleBody
from api.routes.dashboard import COOKIE
from core.formats import ALLOWED_FIELDS, Api
from core.formats.messages import MESSAGES_BETAS
from core.jsonbody import JSON_DEPTH_MAX
from core.limits import RESERVATION_ID_LEN_MAX, RESERVATION_TTL_MS_MAX
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider
from tests.api.conftest import ADMIN_TOKEN, client_for

# Cases per route: enough to draw each kind of body and header many times over, few enough that
# the module runs in about half a minute on a 2-core machine.
CASES_PER_ROUTE = 120
# This module's models (test_fuzz.py's are its own), priced alike by the service and the stub:
# one micro-dollar an input token, four an output.
MODEL = "fuzzb-m1"
CLAUDE_MODEL = "fuzzb-c1"
EMBEDDING_MODEL = "fuzzb-e1"  # the embeddings route's: an input rate only
RATES = {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "4.00"}
EMBEDDING_RATES = {"input_usd_per_mtok": "1.00"}
# The stub serves a model by the embeddings API when its entry says how.
STUB_EMBEDDING = {**EMBEDDING_RATES, "output_usd_per_mtok": "0", "embedding": {
    "dimensions": 64, "dimensions_settable": True, "input_tokens_max": 8_192}}
# The stub serves a model by Anthropic's API when its entry says how (infra/stub_prices.py).
STUB_CLAUDE = {**RATES, "anthropic": {
    "context_window_tokens": 200_000, "output_tokens_max": 64_000, "cache_tokens_min": 1_024,
    "tool_prompt_tokens": {"auto": 346, "any": 313}, "keeps_thinking": False}}
API_VERSION = "2023-06-01"
# Room for every call the fuzz gets served: each holds a few hundred micro-dollars at most.
CEILING_MICROS = 10_000_000
# What a reservation made for a settle or release case holds.
LIVE_AMOUNT_MICROS = 50
# Depths around the limit, and far past it: 1,000 overflows pydantic's parser (the sidecar's),
# 50,000 overflowed json.loads' C recursion (the gateway's 500 this module guards against).
DEPTHS = (JSON_DEPTH_MAX - 1, JSON_DEPTH_MAX, JSON_DEPTH_MAX + 1, 1_000, 50_000)
DEPTHS_PAST = tuple(d for d in DEPTHS if d > JSON_DEPTH_MAX)
# Digits of numbers past int64 (19, 20), past a float (309) and past the 4,300 digits Python
# converts between int and str (a ValueError, not an OverflowError).
DIGITS_HUGE = (19, 20, 309, 4_300, 4_301, 5_000)
# A header value long enough to be no key, id or flag, short of the HTTP server's head limit.
HEADER_BYTES_LONG = 8_000


class Key(enum.Enum):
    """A header value the case names and the test fills in with a real credential."""

    ROUTE = "the key with the route's role"
    OTHER = "the key with the other role"
    ADMIN = "the admin token"


class Live(enum.Enum):
    """The reservation id segment of a reservation made for the case (then released)."""

    ID = "a live reservation"


@dataclass(frozen=True)
class Raw:
    """JSON text written as it is: what Python's json would not write (a number past any int or
    float, a lone surrogate's escape)."""

    text: str


@dataclass(frozen=True)
class Obj:
    """A JSON object as its members in order, where a key may come twice."""

    members: tuple[tuple[str | Raw, Any], ...]


def encode(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        value = Obj(tuple(value.items()))
    if isinstance(value, Obj):
        return "{" + ",".join(f"{encode(k) if isinstance(k, Raw) else json.dumps(k)}:{encode(v)}"
                              for k, v in value.members) + "}"
    if isinstance(value, list):
        return "[" + ",".join(encode(v) for v in value) + "]"
    return json.dumps(value)


def nested(levels: int, opener: str) -> str:
    """`levels` levels of arrays or of objects, one inside the other."""
    if opener == "[":
        return "[" * levels + "]" * levels
    return '{"a":' * (levels - 1) + "{}" + "}" * (levels - 1)


@dataclass(frozen=True)
class Route:
    name: str
    method: str
    path: str  # {id}: where a reservation id goes
    sidecar: bool  # whose key is the route's: the sidecar role's, or the gateway's
    valid: dict[str, Any] | None  # a body the route serves; None: it reads none
    fields: tuple[str, ...]  # the top-level fields its body takes

    def url(self, segment: str, query: str) -> str:
        return self.path.replace("{id}", segment) + (f"?{query}" if query else "")


HI = [{"role": "user", "content": "hi"}]
ROUTES = (
    Route("chat", "POST", "/v1/chat/completions", False,
          {"model": MODEL, "max_tokens": 16, "messages": HI},
          tuple(sorted(ALLOWED_FIELDS[Api.CHAT]))),
    Route("responses", "POST", "/v1/responses", False,
          {"model": MODEL, "max_output_tokens": 16, "input": "hi"},
          tuple(sorted(ALLOWED_FIELDS[Api.RESPONSES]))),
    Route("messages", "POST", "/v1/messages", False,
          {"model": CLAUDE_MODEL, "max_tokens": 16, "messages": HI},
          tuple(sorted(ALLOWED_FIELDS[Api.MESSAGES]))),
    Route("embeddings", "POST", "/v1/embeddings", False,
          {"model": EMBEDDING_MODEL, "input": "hi"},
          tuple(sorted(ALLOWED_FIELDS[Api.EMBEDDINGS]))),
    Route("reserve", "POST", "/v1/reservations", True,
          {"model": MODEL, "input_tokens": 10, "max_output_tokens": 16},
          tuple(ReserveBody.model_fields)),
    Route("settle", "POST", "/v1/reservations/{id}/settle", True,
          {"actual_micros": LIVE_AMOUNT_MICROS // 2}, tuple(SettleBody.model_fields)),
    Route("release", "POST", "/v1/reservations/{id}/release", True, None, ()),
    Route("budgets", "GET", "/v1/budgets/me", True, None, ()),
    Route("usage", "GET", "/v1/usage/me", True, None, ()),
)
BY_NAME = {r.name: r for r in ROUTES}
BODY_ROUTES = tuple(r for r in ROUTES if r.valid is not None)
BODYLESS_ROUTES = tuple(r for r in ROUTES if r.valid is None)


# -- what Hypothesis draws ---------------------------------------------------------------------

SURROGATES = ("\\ud800", "\\udfff", "\\udbff\\udbff", "a\\udc00b")
NUMBER_TEXTS = ("1e400", "-1e400", "1e-400", "-0", "1E+99999", "0.5e-99999", "NaN", "Infinity",
                "-Infinity", "18446744073709551616", "-9223372036854775809", "1.0", "1e2")
huge_numbers = st.one_of(
    st.sampled_from(NUMBER_TEXTS),
    st.builds(lambda sign, digits: sign + "9" * digits, st.sampled_from(("", "-")),
              st.sampled_from(DIGITS_HUGE)),
).map(Raw)
surrogate_strings = st.sampled_from(SURROGATES).map(lambda s: Raw(f'"{s}"'))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=16), huge_numbers, surrogate_strings,
)


def keys_of(route: Route) -> st.SearchStrategy[str | Raw]:
    named = st.sampled_from(route.fields) if route.fields else st.just("model")
    return st.one_of(named, st.text(max_size=12), surrogate_strings)


def objects(keys: st.SearchStrategy[str | Raw], values: st.SearchStrategy[Any]
            ) -> st.SearchStrategy[Obj]:
    """Objects of random members, keys repeated as they happen to be drawn."""
    return st.lists(st.tuples(keys, values), max_size=5).map(lambda m: Obj(tuple(m)))


def json_values(keys: st.SearchStrategy[str | Raw]) -> st.SearchStrategy[Any]:
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | objects(keys, kids),
                        max_leaves=10)


def edited(valid: dict[str, Any], edits: list[tuple[str, str | Raw, Any]]) -> str:
    """A served body with fields set, dropped or given a second time."""
    members: list[tuple[str | Raw, Any]] = list(valid.items())
    for op, key, value in edits:
        if op != "again":
            members = [(k, v) for k, v in members if k != key]
        if op != "drop":
            members.append((key, value))
    return encode(Obj(tuple(members)))


def deep(valid: dict[str, Any], depth: int, opener: str, key: str, top: bool) -> str:
    """A body `depth` levels deep: the nesting as the whole body, or under a field of a served
    one (which is the first level)."""
    if top:
        return nested(depth, opener)
    return encode({**valid, key: Raw(nested(depth - 1, opener))})


# Sequences no UTF-8 decoder accepts: a byte that never occurs, a lone continuation byte, an
# overlong NUL, a surrogate encoded, a code point past U+10FFFF, a sequence cut short.
NOT_UTF8 = (b"\xff", b"\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82",
            b"\xfe\xff")
PLACEHOLDER = "\u0001hole\u0001"


def spliced(text: str, bad: bytes, at: int) -> bytes:
    """`text` as UTF-8 with `bad` in place of its placeholder, or else at `at`."""
    raw = text.encode()
    hole = json.dumps(PLACEHOLDER)[1:-1].encode()
    if hole in raw:
        return raw.replace(hole, bad)
    at %= len(raw) + 1
    return raw[:at] + bad + raw[at:]


NOT_OBJECTS = (b"", b" ", b"null", b"true", b"0", b"-0", b"1e400", b'"x"', b"[]", b"[{}]", b"{",
               b"}", b"{}{}", b'{"a":1}x', b"\x00", b"\xef\xbb\xbf{}")
# JSON in encodings other than UTF-8 (json.loads takes UTF-16 and UTF-32 bytes; pydantic does not).
ENCODINGS = ("utf-16", "utf-16-le", "utf-32", "utf-8-sig")


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each drawn in proportion to its weight (st.one_of draws its
    branches alike, a branch given twice included)."""
    return st.sampled_from([s for weight, s in choices for _ in range(weight)]).flatmap(
        lambda s: s)


def bodies(route: Route) -> st.SearchStrategy[bytes | None]:
    keys = keys_of(route)
    values = json_values(keys)
    valid = route.valid if route.valid is not None else {"model": MODEL}
    fields = route.fields or ("model",)
    # Mostly a served body with a few fields changed: most get past the parser to the checks
    # behind it, and some are served.
    served = st.lists(st.tuples(st.sampled_from(("set", "drop", "again")), keys, values),
                      max_size=3).map(lambda e: edited(valid, e))
    texts = st.one_of(values.map(encode), objects(keys, values).map(encode), served)
    in_a_string = st.sampled_from(fields).map(
        lambda f: encode({**valid, f: "x" + PLACEHOLDER}))
    return weighted(
        (2, st.just(encode(valid).encode())),
        (4, served.map(str.encode)),
        (2, objects(keys, values).map(encode).map(str.encode)),
        (1, values.map(encode).map(str.encode)),
        (2, st.builds(deep, st.just(valid), st.sampled_from(DEPTHS), st.sampled_from("[{"),
                      st.sampled_from(fields), st.booleans()).map(str.encode)),
        (2, st.builds(spliced, st.one_of(texts, in_a_string), st.sampled_from(NOT_UTF8),
                      st.integers(min_value=0))),
        (1, st.sampled_from(NOT_OBJECTS)),
        (1, st.sampled_from(ENCODINGS).map(lambda e: encode(valid).encode(e, errors="replace"))),
        (1, st.none()),
    )


# Octets HTTP carries in a header value (no CR, LF or NUL); spaces and tabs only inside it.
HEADER_OCTETS = (*range(0x21, 0x7F), *range(0x80, 0x100), 0x20, 0x09)
junk = st.one_of(
    st.lists(st.sampled_from(HEADER_OCTETS), max_size=40).map(lambda o: bytes(o).strip(b" \t")),
    st.integers(min_value=1_000, max_value=HEADER_BYTES_LONG).map(lambda n: b"x" * n),
)
# An Authorization that is not the route's key: the other role's, the admin token, or junk
# after a scheme.
keyed = st.sampled_from((Key.OTHER, Key.ADMIN)) | st.builds(
    lambda scheme, value: (scheme + value).strip(b" \t"),
    st.sampled_from((b"Bearer ", b"bearer", b"Basic ", b"Bearer sk-ceil-")), junk)


def header(good: st.SearchStrategy[Any], *, weight: int = 1) -> st.SearchStrategy[Any]:
    """A header's value: mostly absent (junk in a header read before the body would keep most
    bodies from their parser), else junk or a good one (drawn `weight` times as often)."""
    return weighted((3, st.none()), (1, junk), (weight, good))


HEADERS: dict[str, st.SearchStrategy[Any]] = {
    # Mostly the route's own key, so that most bodies get past the key to their parser.
    "Authorization": weighted((8, st.just(Key.ROUTE)), (2, keyed), (1, st.none())),
    "x-api-key": header(st.just(Key.ROUTE)),
    "Idempotency-Key": header(st.uuids().map(lambda u: u.hex.encode())),
    "X-Ceiling-Run-Id": header(st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True).map(
        str.encode)),
    "anthropic-version": header(st.just(API_VERSION.encode()), weight=6),
    "anthropic-beta": header(st.lists(st.sampled_from(sorted(MESSAGES_BETAS)), min_size=1,
                                      max_size=3).map(lambda b: ",".join(b).encode())),
    "Content-Type": header(st.sampled_from((
        b"application/json", b"application/json; charset=utf-8", b"text/plain",
        b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x",
        b"application/json; charset=utf-16"))),
}
headers = st.fixed_dictionaries(HEADERS).map(
    lambda h: tuple((name, value) for name, value in h.items() if value is not None))


def quoted(raw: bytes) -> str:
    return urllib.parse.quote_from_bytes(raw, safe="")


# A live reservation's id half the time, so that settle's bodies reach its parser and the ledger.
segments = weighted(
    (3, st.just(Live.ID)),
    (1, st.from_regex(rf"[A-Za-z0-9_.-]{{1,{RESERVATION_ID_LEN_MAX + 1}}}", fullmatch=True)),
    (1, st.text(min_size=1, max_size=40).map(lambda t: urllib.parse.quote(t, safe=""))),
    (1, st.binary(min_size=1, max_size=40).map(quoted)),
)
# What GET /v1/usage/me reads (hours) and refuses (anything else).
queries = st.one_of(
    st.just(""),
    st.one_of(st.sampled_from(("1", "840", "841", "0", "-1", "1.5", "0x10", "", "9" * 5_000,
                               "\u00b2", "\u0663")),
              st.text(max_size=8)).map(lambda h: "hours=" + urllib.parse.quote(h, safe="")),
    st.binary(max_size=8).map(lambda h: "hours=" + quoted(h)),
    st.lists(st.tuples(st.binary(min_size=1, max_size=6), st.binary(max_size=6)), max_size=2).map(
        lambda q: "&".join(f"{quoted(k)}={quoted(v)}" for k, v in q)),
)


@dataclass(frozen=True)
class Case:
    body: bytes | None
    headers: tuple[tuple[str, bytes | Key], ...]
    segment: str | Live
    query: str


def cases(route: Route) -> st.SearchStrategy[Case]:
    return st.builds(
        Case, bodies(route), headers,
        segments if "{id}" in route.path else st.just(""),
        queries if route.name == "usage" else st.just(""),
    )


# -- the instance and the checks ---------------------------------------------------------------


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=17, latency_ms_min=0, latency_ms_max=2, output_tokens_mean=12,
                      prices={"models": {MODEL: RATES, CLAUDE_MODEL: STUB_CLAUDE,
                                         EMBEDDING_MODEL: STUB_EMBEDDING}}) as provider:
        yield provider


@pytest.fixture(scope="module")
def fuzzed(redis_server: RedisServer, stub: StubProvider,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    prices = Path(tmp_path_factory.mktemp("fuzz_bodies")) / "prices.json"
    prices.write_text(json.dumps({"models": {MODEL: RATES, CLAUDE_MODEL: RATES,
                                             EMBEDDING_MODEL: EMBEDDING_RATES}}))
    with ServiceProcess({
        "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_PRICES_FILE": str(prices), "CEILING_UPSTREAM_URL": f"{stub.url}/v1",
        "CEILING_ANTHROPIC_URL": stub.url, "CEILING_UPSTREAM_TIMEOUT_S": "30",
        # The longest lease: no hold a case leaves open expires, and moves money, during a later
        # case (which would then be seen as a refusal that moved it).
        "CEILING_LEASE_TTL_MS": str(RESERVATION_TTL_MS_MAX),
    }) as service:
        yield service


class Books:
    """Two budgets, one for each role's key, and the checks run after each case."""

    def __init__(self, service: ServiceProcess, stub: StubProvider, http: httpx.Client) -> None:
        self.service, self.stub, self.http = service, stub, http
        with client_for(service) as admin:
            # Budgets of their own: the session's Redis outlives the module.
            self.tags = {role: f"org:fb{role}{uuid.uuid4().hex[:8]}" for role in ("g", "s")}
            for tag in self.tags.values():
                admin.budget(tag, CEILING_MICROS)
            self.gateway_key = admin.key(self.tags["g"])["Authorization"].removeprefix("Bearer ")
            self.sidecar_key = admin.sidecar_key(self.tags["s"])["Authorization"].removeprefix(
                "Bearer ")

    def ledger(self) -> dict[str, dict[str, Any]]:
        """Each budget's one period, as the admin API reads it from the ledger."""
        found = {}
        for tag in self.tags.values():
            got = self.http.get(f"/v1/admin/budgets/{tag}",
                                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert got.status_code == 200, got.text
            [found[tag]] = got.json()["periods"]
        return found

    def stub_bill(self, *, with_log: bool = False) -> dict[str, Any]:
        got = self.http.get(f"{self.stub.url}/billing", params={"log": int(with_log)})
        assert got.status_code == 200
        bill: dict[str, Any] = got.json()
        return bill

    def credential(self, route: Route, value: bytes | Key, name: str) -> bytes:
        if not isinstance(value, Key):
            return value
        own, other = ((self.sidecar_key, self.gateway_key) if route.sidecar
                      else (self.gateway_key, self.sidecar_key))
        key = {Key.ROUTE: own, Key.OTHER: other, Key.ADMIN: ADMIN_TOKEN}[value]
        return (f"Bearer {key}" if name == "Authorization" else key).encode()

    def reserve(self, amount_micros: int = LIVE_AMOUNT_MICROS) -> str:
        made = self.http.post("/v1/reservations", json={"amount_micros": amount_micros},
                              headers={"Authorization": f"Bearer {self.sidecar_key}"})
        assert made.status_code == 201, made.text
        reservation_id: str = made.json()["reservation_id"]
        return reservation_id

    def release(self, reservation_id: str) -> None:
        """Give back what a case left held, so nothing expires (and moves) during a later case."""
        done = self.http.post(f"/v1/reservations/{quoted(reservation_id.encode())}/release",
                              headers={"Authorization": f"Bearer {self.sidecar_key}"})
        assert done.status_code < 500, done.text

    def send(self, route: Route, case: Case, segment: str) -> httpx.Response:
        sent = [(name.encode(), self.credential(route, value, name))
                for name, value in case.headers]
        return self.http.request(route.method, route.url(segment, case.query),
                                 content=case.body, headers=sent)

    def check(self, route: Route, case: Case) -> httpx.Response:
        live = self.reserve() if case.segment is Live.ID else None
        segment = live if live is not None else str(case.segment)
        before = self.ledger()
        requests_before = self.stub_bill()["requests"] if not route.sidecar else 0
        try:
            answer = self.send(route, case, segment)
            self.judge(route, case, answer, before, requests_before)
        finally:
            if live is not None:
                self.release(live)
        return answer

    def judge(self, route: Route, case: Case, answer: httpx.Response,
              before: dict[str, dict[str, Any]], requests_before: int) -> None:
        status = answer.status_code
        reservation = answer.headers.get("x-ceiling-reservation-id")
        if status >= 500:
            # A provider's error relayed is the provider's: the gateway held for the call and
            # the stub's last answer was this one.
            bill = self.stub_bill(with_log=True)
            relayed = (reservation is not None and bill["requests"] > requests_before
                       and bill["log"][-1]["status"] == status)
            assert relayed, (route.name, case, status, answer.text[:500])
        after = self.ledger()
        if 400 <= status < 500 and reservation is None:
            # Refused by the service itself: nothing was held, charged or given back.
            assert {tag: (p["committed_micros"], p["reserved_micros"])
                    for tag, p in after.items()} == {
                tag: (p["committed_micros"], p["reserved_micros"]) for tag, p in before.items()
            }, (route.name, case, status, answer.text[:300])
            return
        for period in after.values():
            assert period["reserved_micros"] >= 0, period
            assert period["committed_micros"] + period["reserved_micros"] <= (
                period["ceiling_micros"] + period["overshoot_micros"]), period
        if not route.sidecar:
            billed = self.stub_bill()["cost_micros"]
            assert billed <= after[self.tags["g"]]["committed_micros"], (route.name, case, billed)
        if route.name == "reserve" and status in (200, 201):
            self.release(answer.json()["reservation_id"])


@pytest.fixture(scope="module")
def books(fuzzed: ServiceProcess, stub: StubProvider) -> Iterator[Books]:
    # One client for every case: a new one a case would cost more CPU than the case.
    with httpx.Client(base_url=fuzzed.url, timeout=60.0) as http:
        yield Books(fuzzed, stub, http)


def plain(body: bytes | None, route: Route) -> Case:
    """A case with the route's key and nothing else but `body` (and a live reservation's id)."""
    extra = (("anthropic-version", API_VERSION.encode()),) if route.name == "messages" else ()
    segment = Live.ID if "{id}" in route.path else ""
    return Case(body, (("Authorization", Key.ROUTE), *extra), segment, "")


# -- deep JSON, case by case ---------------------------------------------------------------------


@pytest.mark.parametrize("depth", DEPTHS_PAST)
@pytest.mark.parametrize("where", ["array", "object", "in a field"])
@pytest.mark.parametrize("route", BODY_ROUTES, ids=lambda r: r.name)
def test_deep_json_is_refused_on_every_route_that_reads_a_body(
        books: Books, route: Route, where: str, depth: int) -> None:
    assert route.valid is not None
    # The gateway's metadata is a field of its own; the sidecar's first field takes a scalar.
    field = "metadata" if "metadata" in route.fields else route.fields[0]
    body = deep(route.valid, depth, "{" if where == "object" else "[", field,
                top=where != "in a field")
    answer = books.check(route, plain(body.encode(), route))
    assert answer.status_code == 422, answer.text[:300]
    if where != "array":
        # An array is refused as no object, or as too deep: whichever its parse meets first.
        assert f"nested deeper than {JSON_DEPTH_MAX}" in answer.text, answer.text[:300]


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("route", BODYLESS_ROUTES, ids=lambda r: r.name)
def test_deep_json_is_not_read_by_a_route_that_takes_no_body(
        books: Books, route: Route, depth: int) -> None:
    """Release, budgets and usage read no body: one nested however deep is answered as no body
    is (release of an unknown id: 404; the caller's own budgets: 200), never a 5xx."""
    for opener in "[{":
        segment = f"r{depth}" if "{id}" in route.path else ""
        deep_body = nested(depth, opener).encode()
        with_body = books.check(route, Case(deep_body, (("Authorization", Key.ROUTE),),
                                            segment, ""))
        without = books.check(route, Case(None, (("Authorization", Key.ROUTE),), segment, ""))
        assert with_body.status_code == without.status_code == (
            404 if "{id}" in route.path else 200), with_body.text[:300]


# Where each gateway route takes a JSON object of the caller's own (a tool's JSON Schema), and
# the level of the body it sits at.
TOOLS: dict[str, tuple[int, Callable[[Raw], dict[str, Any]]]] = {
    "chat": (5, lambda schema: {"type": "function", "function": {"name": "f",
                                                                 "parameters": schema}}),
    "responses": (4, lambda schema: {"type": "function", "name": "f", "parameters": schema}),
    "messages": (4, lambda schema: {"name": "f", "input_schema": schema}),
}


@pytest.mark.parametrize("depth", [JSON_DEPTH_MAX - 1, JSON_DEPTH_MAX, JSON_DEPTH_MAX + 1])
@pytest.mark.parametrize("name", sorted(TOOLS))
def test_the_gateway_serves_a_body_as_deep_as_the_limit_and_refuses_one_level_more(
        books: Books, name: str, depth: int) -> None:
    route = BY_NAME[name]
    assert route.valid is not None
    level, tool = TOOLS[name]
    schema = Raw('{"type":"object","x":' + nested(depth - level, "{") + "}")
    body = encode({**route.valid, "tools": [tool(schema)]})
    answer = books.check(route, plain(body.encode(), route))
    if depth > JSON_DEPTH_MAX:
        assert answer.status_code == 422, answer.text[:300]
        assert f"nested deeper than {JSON_DEPTH_MAX}" in answer.text
    else:
        assert answer.status_code == 200, answer.text[:300]


# Content-Length values the HTTP server passes on, and the answer each gets: 2 however many zeros
# lead it (the body, {}, is then a reserve that names no call), and one byte over the limit.
CONTENT_LENGTHS = ((b"0" * 5_000 + b"2", 422), (b"0002", 422),
                   (str(BODY_BYTES_MAX + 1).encode(), 413))


@pytest.mark.parametrize(("length", "status"), CONTENT_LENGTHS,
                         ids=lambda v: f"{len(v)}-digits" if isinstance(v, bytes) else str(v))
def test_a_content_length_of_any_digits_is_answered_without_a_5xx(
        books: Books, length: bytes, status: int) -> None:
    """The body limit reads Content-Length before any route: a number of thousands of digits
    is still a number of bytes (int() refuses over 4,300 digits). Sent by hand: an HTTP client
    writes its own."""
    port = httpx.URL(books.service.url).port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /v1/reservations HTTP/1.1\r\nHost: fuzz\r\nAuthorization: Bearer "
                     + books.sidecar_key.encode() + b"\r\nContent-Length: " + length
                     + b"\r\nConnection: close\r\n\r\n{}")
        status_line = conn.recv(64).split(b"\r\n", 1)[0]
    assert status_line.split(b" ")[1] == str(status).encode(), status_line


# -- 5xx the fuzz found, each kept as a case of its own ----------------------------------------


@pytest.mark.parametrize("route", BODY_ROUTES[:3], ids=lambda r: r.name)
def test_a_field_named_with_a_lone_surrogate_is_refused_with_a_4xx(
        books: Books, route: Route) -> None:
    assert route.valid is not None
    body = encode(Obj((*route.valid.items(), (Raw('"\\ud800"'), 1))))
    assert books.check(route, plain(body.encode(), route)).status_code == 422


@pytest.mark.parametrize("hours", ["%C2%B2", "9" * 5_000])
def test_hours_that_are_no_whole_number_are_refused_with_a_4xx(books: Books, hours: str) -> None:
    case = Case(None, (("Authorization", Key.ROUTE),), "", f"hours={hours}")
    assert books.check(BY_NAME["usage"], case).status_code == 422


@pytest.mark.parametrize("expiry", [b"\xb2", b"9" * 5_000])
def test_a_session_cookie_of_no_whole_number_is_no_session(books: Books, expiry: bytes) -> None:
    cookie = COOKIE.encode() + b"=v1." + expiry + b".mac"
    answer = books.http.get("/dashboard", headers=[(b"Cookie", cookie)])
    assert answer.status_code < 500


# -- everything else, drawn ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_no_drawn_request_is_answered_5xx_or_moves_money_when_refused(
        books: Books, route: Route) -> None:
    @settings(max_examples=CASES_PER_ROUTE, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(case=cases(route))
    def run(case: Case) -> None:
        books.check(route, case)

    run()
