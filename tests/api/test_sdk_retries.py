"""What the real `openai` and `anthropic` SDKs do with each refusal of rates, users and budgets.

Both SDKs retry 408, 409, 429 and >= 500 (max_retries, 2 by default) unless the answer says
`x-should-retry: false`, waiting what `retry-after-ms` / `Retry-After` says (openai up to 120 s,
past that it does not retry; anthropic whatever it says), else a backoff of about 0.5 s, 1 s...
So:
- 429 rate_limited and 429 concurrency_limited are retried after their Retry-After, and a retry
  made once the window or a slot allows it passes: shown here with the real SDK clients
  (max_retries=2), recording each HTTP request the SDK sent (its transport's hooks) and
  counting the calls the stub provider billed. A wait between the refusal and the retry of at
  least its Retry-After (1 s or more) tells the server's delay from the SDK's own backoff (under
  0.5 s for a first retry).
- 402 budget_exceeded (the key's budget or its end user's) says `x-should-retry: false`, and
  403 users_exhausted and 400 user_required are statuses neither SDK retries: one request each.

The rate's window is a minute; rather than wait one out, the test ages the first call's entry in
the ledger's rate log to 58.5 s old (what 58.5 s of waiting would do), so the refusal's
Retry-After is 1 or 2 s. A concurrency slot is held by a sidecar reservation of the same user
that the test releases once the SDK's first request was refused. docs/rates.md documents this
behaviour.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx2
import openai
import pytest
import redis

from core.limits import RATE_WINDOW_MS
from core.stores import keys
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill
from tests.api.conftest import (
    Client,
    anthropic_sdk,
    as_key,
    counting_client,
    gateway_to_stub,
    per_user_budget,
    sdk,
)
from tests.support import write_prices

MODEL = "gpt-4o"
ANTHROPIC_MODEL = "claude-haiku-4-5"
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
MAX_OUTPUT_TOKENS = 50
ROOMY_MICROS = 10_000_000
# Below one call's hold (~530 micro-dollars for gpt-4o at 50 output tokens): refused at once.
TOO_SMALL_MICROS = 100
# The rate test leaves its first call this long inside the window: a Retry-After of 1 or 2 s.
RATE_LEFT_MS = 1_500
# The SDKs' first backoff without a Retry-After is at most 0.5 s (INITIAL_RETRY_DELAY, jittered
# down): a retry that waited at least this long waited for the server's Retry-After.
RETRY_AFTER_S = 1.0
# How long the SDK's first request may take to be answered.
REFUSAL_WAIT_S_MAX = 10.0
SDK_RETRIES = 2
# The lease of the reservation that holds a concurrency slot while an SDK's call is refused.
HELD_TTL_MS = 2_000
# A refusal that is not retried is answered at once: well under any backoff.
NO_RETRY_ELAPSED_S_MAX = 0.5


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_prices(tmp_path_factory, "sdk_retries", {"models": {}})


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=31, latency_ms_min=0, latency_ms_max=2) as provider:
        yield provider


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, prices_file: str, stub: StubProvider
       ) -> Iterator[ServiceProcess]:
    with gateway_to_stub(redis_server, prices_file, stub, 30) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_provider(stub: StubProvider) -> None:
    """Each test is judged by its own bill."""
    reset_bill(stub.url)


def account(admin: Client, *, ceiling_micros: int = ROOMY_MICROS,
            user_ceiling_micros: int = ROOMY_MICROS, users_max: int = 100,
            required: bool = False, rate: dict[str, int] | None = None,
            user_rate: dict[str, int] | None = None) -> tuple[str, str]:
    """A budget with per-user limits (and the rates given), and a key with both roles."""
    tag = f"org:r{uuid.uuid4().hex[:10]}"
    body = per_user_budget(ceiling_micros, user_ceiling_micros, users_max, required, rate,
                           user_rate)
    r = admin.admin("PUT", f"/v1/admin/budgets/{tag}", json=body)
    assert r.status_code == 200, r.text
    r = admin.admin("POST", "/v1/admin/keys",
                    json={"budget_id": tag, "roles": ["gateway", "sidecar"]})
    assert r.status_code == 201, r.text
    return tag, str(r.json()["api_key"])


# One call through either SDK's client: (gateway, key, the user to name or None, a transport
# that counts what it sends or None, max_retries) -> the SDK's answer.
Call = Callable[[ServiceProcess, str, str | None, httpx2.Client | None, int], Any]


def openai_call(gw: ServiceProcess, key: str, user: str | None,
                http_client: httpx2.Client | None, max_retries: int) -> Any:
    return sdk(gw, key, max_retries=max_retries, http_client=http_client).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=MAX_OUTPUT_TOKENS, service_tier="default",
        user=openai.omit if user is None else user)


def anthropic_call(gw: ServiceProcess, key: str, user: str | None,
                   http_client: httpx2.Client | None, max_retries: int) -> Any:
    client = anthropic_sdk(gw, key, max_retries=max_retries, http_client=http_client)
    return client.messages.create(
        model=ANTHROPIC_MODEL, messages=HELLO, max_tokens=MAX_OUTPUT_TOKENS,
        metadata=anthropic.omit if user is None else {"user_id": user})


SDKS: dict[str, Call] = {"openai": openai_call, "anthropic": anthropic_call}
STATUS_ERRORS = (openai.APIStatusError, anthropic.APIStatusError)
StatusError = openai.APIStatusError | anthropic.APIStatusError


def refusal_of(raised: pytest.ExceptionInfo[Exception]) -> StatusError:
    error = raised.value
    assert isinstance(error, STATUS_ERRORS), error
    return error


def code_of(error: StatusError) -> str:
    body = error.body
    inner = body.get("error") if isinstance(body, dict) else None
    code = inner.get("code") if isinstance(inner, dict) else None
    if code is None and isinstance(body, dict):
        code = body.get("code")  # openai's errors are the error object itself
    return str(code)


@dataclass
class Attempt:
    """One HTTP request an SDK sent, as its transport saw it (monotonic seconds)."""

    sent_s: float
    status: int | None = None
    retry_after_s: float | None = None
    answered_s: float | None = None


def recording_client() -> tuple[httpx2.Client, list[Attempt]]:
    """An SDK transport (either SDK's) that records every request it sends, retries included,
    with the status, the Retry-After and the time of its answer."""
    attempts: list[Attempt] = []

    def sent(_: httpx2.Request) -> None:
        attempts.append(Attempt(time.monotonic()))

    def answered(response: httpx2.Response) -> None:
        retry_after = response.headers.get("retry-after")
        attempts[-1].status = response.status_code
        attempts[-1].retry_after_s = None if retry_after is None else float(retry_after)
        attempts[-1].answered_s = time.monotonic()

    return httpx2.Client(event_hooks={"request": [sent], "response": [answered]}), attempts


def check_retried(attempts: list[Attempt]) -> None:
    """Refused once with a Retry-After, then retried no sooner than it said, and passed."""
    assert [a.status for a in attempts] == [429, 200], attempts
    refused, retry = attempts
    assert refused.retry_after_s is not None
    assert refused.answered_s is not None
    # The SDK's own first backoff is under 0.5 s: this wait is the server's.
    assert retry.sent_s - refused.answered_s >= refused.retry_after_s >= RETRY_AFTER_S, attempts


def described(attempts: list[Attempt]) -> str:
    """Each request's status, and for a retry how long after the answer before it it was sent."""
    parts = [str(attempts[0].status)]
    for before, after in itertools.pairwise(attempts):
        waited_s = after.sent_s - (before.answered_s or before.sent_s)
        parts.append(f"(Retry-After {before.retry_after_s}, waited {waited_s:.2f} s) "
                     f"{after.status}")
    return " ".join(parts)


def rate_log(tag: str, budget_id: str) -> str:
    return f"{keys.prefix(tag)}{keys.RATE}{budget_id}"


def age_rate_log(redis_url: str, tag: str, budget_id: str, age_ms: int) -> None:
    """Every call in the budget's rate log made to have been admitted `age_ms` ago, by the
    ledger's clock (Redis TIME)."""
    raw = redis.Redis.from_url(redis_url)
    try:
        seconds, micros = raw.time()
        now_ms = seconds * 1_000 + micros // 1_000
        name = rate_log(tag, budget_id)
        members = [m for m in raw.zrange(name, 0, -1) if isinstance(m, bytes)]
        assert members, "the first call is not in the rate log"
        raw.zadd(name, dict.fromkeys(members, now_ms - age_ms), xx=True)
    finally:
        raw.close()


# -- retried: 429 rate_limited and concurrency_limited --------------------------------------------


@pytest.mark.slow  # waits out a real Retry-After
@pytest.mark.parametrize(("sdk_name", "scope"), [("openai", "budget"), ("anthropic", "user")])
def test_a_rate_limited_call_is_retried_after_retry_after_and_passes(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
    sdk_name: str, scope: str,
) -> None:
    """requests_per_minute 1 (on the budget, or on each of its users): the second call of the
    minute is refused 429 rate_limited; its SDK waits the Retry-After and retries, and the retry
    passes once the first call has left the window. The stub billed two calls."""
    rate = {"requests_per_minute": 1}
    tag, key = (account(admin, rate=rate) if scope == "budget"
                else account(admin, user_rate=rate))
    user = "retrier"
    limited = tag if scope == "budget" else f"{tag}/user:{user}"
    SDKS[sdk_name](gw, key, user, None, 0)
    # Refused without retries: the whole minute is ahead, and the SDK is not told not to retry.
    with pytest.raises(STATUS_ERRORS) as raised:
        SDKS[sdk_name](gw, key, user, None, 0)
    refused = refusal_of(raised)
    assert (refused.status_code, code_of(refused)) == (429, "rate_limited")
    assert 55 <= int(refused.response.headers["retry-after"]) <= 60
    assert "x-should-retry" not in refused.response.headers

    # The first call made to be as old as the window less RATE_LEFT_MS: the next call is refused
    # with a Retry-After of 1 or 2 s, and a retry after it is inside the window no more.
    age_rate_log(redis_server.url, tag, limited, RATE_WINDOW_MS - RATE_LEFT_MS)
    transport, attempts = recording_client()
    SDKS[sdk_name](gw, key, user, transport, SDK_RETRIES)
    print(f"\nsdk | {sdk_name} | rate_limited on the {scope}: {described(attempts)}")
    check_retried(attempts)
    bill = fetch_bill(stub.url)
    assert bill.requests == bill.total.calls == 2  # the first call and the retry


@pytest.mark.slow  # waits out a real Retry-After
@pytest.mark.parametrize(("sdk_name", "scope"), [("openai", "user"), ("anthropic", "budget")])
def test_a_concurrency_limited_call_is_retried_once_a_slot_frees(
    gw: ServiceProcess, admin: Client, stub: StubProvider, sdk_name: str, scope: str,
) -> None:
    """concurrent_max 1: while another call of the user holds the slot (a sidecar reservation),
    the SDK's call is refused 429 concurrency_limited (its Retry-After: the held lease's end).
    The other call ends as soon as the refusal is seen; the SDK waits the Retry-After, retries,
    and the retry passes.
    The stub billed that one call."""
    rate = {"concurrent_max": 1}
    _, key = (account(admin, rate=rate) if scope == "budget"
              else account(admin, user_rate=rate))
    user = "waiter"
    # A short lease: the refusal's Retry-After is the earliest lease end among the held slots,
    # which the SDKs wait (up to two minutes).
    held = admin.post("/v1/reservations", json={"amount_micros": 1, "ttl_ms": HELD_TTL_MS},
                      headers={**as_key(key), "X-Ceiling-User": user})
    assert held.status_code == 201, held.text
    transport, attempts = recording_client()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(SDKS[sdk_name], gw, key, user, transport, SDK_RETRIES)
        deadline = time.monotonic() + REFUSAL_WAIT_S_MAX
        while not (attempts and attempts[0].status is not None):
            assert time.monotonic() < deadline, "the SDK's first request was never answered"
            time.sleep(0.005)
        released = admin.post(f"/v1/reservations/{held.json()['reservation_id']}/release",
                              headers=as_key(key))
        assert released.status_code == 200, released.text
        answer.result(timeout=30)  # the SDK's retry passed (it raises if it did not)
    print(f"\nsdk | {sdk_name} | concurrency_limited on the {scope}: {described(attempts)}")
    check_retried(attempts)
    bill = fetch_bill(stub.url)
    assert bill.requests == bill.total.calls == 1


# -- not retried: 402, 403, 400 -------------------------------------------------------------------

REFUSALS = ["budget_exceeded", "user_budget_exceeded", "users_exhausted", "user_required"]
EXPECTED = {"budget_exceeded": (402, "budget_exceeded"),
            "user_budget_exceeded": (402, "budget_exceeded"),
            "users_exhausted": (403, "users_exhausted"),
            "user_required": (400, "user_required")}


@pytest.mark.parametrize("sdk_name", sorted(SDKS))
@pytest.mark.parametrize("refusal", REFUSALS)
def test_refusals_a_retry_cannot_fix_are_sent_once(
    gw: ServiceProcess, admin: Client, stub: StubProvider, sdk_name: str, refusal: str,
) -> None:
    """With max_retries=2, each is one HTTP request, answered at once, never forwarded; the
    budget refusals say `x-should-retry: false`, the others are statuses the SDKs do not
    retry."""
    user: str | None = "spender"
    if refusal == "budget_exceeded":
        _, key = account(admin, ceiling_micros=TOO_SMALL_MICROS)
    elif refusal == "user_budget_exceeded":
        _, key = account(admin, user_ceiling_micros=TOO_SMALL_MICROS)
    elif refusal == "users_exhausted":
        _, key = account(admin, users_max=1)
        first = admin.post("/v1/reservations", json={"amount_micros": 1},
                           headers={**as_key(key), "X-Ceiling-User": "the-only-one"})
        assert first.status_code == 201, first.text
    else:
        _, key = account(admin, required=True)
        user = None
    transport, sent = counting_client()
    started = time.monotonic()
    with pytest.raises(STATUS_ERRORS) as raised:
        SDKS[sdk_name](gw, key, user, transport, SDK_RETRIES)
    elapsed_s = time.monotonic() - started
    refused = refusal_of(raised)
    assert (refused.status_code, code_of(refused)) == EXPECTED[refusal]
    assert len(sent) == 1, "the SDK retried a refusal a retry cannot fix"
    assert elapsed_s < NO_RETRY_ELAPSED_S_MAX
    if refused.status_code == 402:
        assert refused.response.headers["x-should-retry"] == "false"
    assert fetch_bill(stub.url).requests == 0
