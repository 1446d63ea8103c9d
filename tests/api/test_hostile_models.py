"""Per-model limits and model allow-lists tried as a hostile key holder would, judged by the
provider's bill and the ledger's records in Redis.

A key holder picks the model of every call, so every name is the attacker's choice. A budget
names each model by the priced model's one name (core/prices PriceTable.model_name), and the
gateway counts a call by the same name: each attack below tries to spend past a model's limit,
or call a model the budget does not allow, under another name of it.
- Name variants: a dated snapshot (`gpt-4o-2024-08-06`), an alias genai-prices gives the same
  entry (`gpt-4o-2024-11-20`, `gemini-2.5-flash-latest`), another case (`GPT-4o`), the routed
  forms (`oai/gpt-4o`, `<upstream>/<model>`; `openai/gpt-4o`, which an OpenRouter-priced
  upstream lists and prices as gpt-4o),
  an Azure deployment of it (`prod-4o`), and Claude through Bedrock by its model id
  (`global.anthropic.claude-haiku-4-5-...` by `model_ids`, `us.anthropic...` listed in
  `models`) or prefix (`bedrock/...`): all count
  in one counter, `<budget>/model:<one name>`, and none passes an allow-list that does not name
  the model. A name with a suffix of its own (`gpt-4o-x`) is not routed or priced: refused
  before anything is held.
- A key cannot put or change a budget (nor its per_model limits).
- 50 concurrent reservations against a model's ceiling, spread over two instances: exactly the
  number that fits is admitted.
- Two instances on one Redis hold a model's limit on the chat, Responses, Messages and Gemini
  routes by the stub's bill; a call the model's room no longer fits is refused before the stub
  sees anything.

Through two real gateway instances (ServiceProcess) on the session's Redis, routing by
CEILING_UPSTREAMS to the stub provider, whose bill is the judge.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.budgets import BudgetId
from core.stores import keys
from infra.processes import tls_context
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill, stub_control
from tests.api.conftest import ADMIN_TOKEN, as_key
from tests.api.hostile import blocking, expire_held
from tests.api.test_hostile_users import (
    admin_call,
    code_of,
    counters,
    new_key,
    send_all,
    unchanged_state,
)
from tests.support import write_prices

pytestmark = pytest.mark.slow

STUB_KEY = "models-stub-key"
ACCESS_KEY, SECRET_KEY, REGION = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMIEXAMPLEKEY", "us-east-1"
GLOBAL_HAIKU = "global.anthropic.claude-haiku-4-5-20251001-v1:0"
# A geographic profile's id listed in a Bedrock upstream's `models` (no `model_ids` entry).
US_HAIKU = "us.anthropic.claude-haiku-4-5-20251001-v1:0"
ANTHROPIC_VERSION = "2023-06-01"
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
MAX_OUTPUT_TOKENS = 100
# Every answer runs to its cap: a call's bill is its hold, near enough, so a model's room is
# used up in a few calls.
OUTPUT_TOKENS_MEAN = 1_000_000
ROOMY_MICROS = 100_000_000
# Calls of one attack before it must have been refused: far more than any ceiling here holds.
CALLS_MAX = 30

# The names of one model a call may use, each routed (CEILING_UPSTREAMS below), by route.
GPT4O_NAMES = ("gpt-4o", "gpt-4o-2024-08-06", "GPT-4o", "openai/gpt-4o", "prod-4o",
               "gpt-4o-2024-11-20", "oai/gpt-4o")
HAIKU_NAMES = ("anthropic/claude-haiku-4-5", "claude-haiku-4-5-20251001", GLOBAL_HAIKU,
               "bedrock/claude-haiku-4-5", US_HAIKU)
FLASH_NAMES = ("gemini-2.5-flash", "gemini-2.5-flash-latest")
ONE_NAME = {"chat": "gpt-4o", "responses": "gpt-4o", "messages": "claude-haiku-4-5",
            "gemini": "gemini-2.5-flash"}
NAMES = {"chat": GPT4O_NAMES, "responses": GPT4O_NAMES, "messages": HAIKU_NAMES,
         "gemini": FLASH_NAMES}


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    # The stub's own table, with gpt-4o's dated names as aliases of it (as genai-prices has
    # them): OpenAI bills a snapshot at its model's price.
    table = json.loads(Path("infra/stub_prices.json").read_text())
    models = table.get("models", table)
    # OpenRouter bills `openai/gpt-4o` at OpenAI's price too.
    gpt4o = {**models["gpt-4o"], "aliases": ["gpt-4o-2024-08-06", "gpt-4o-2024-11-20",
                                             "openai/gpt-4o"]}
    with StubProvider(seed=43, latency_ms_min=0, latency_ms_max=2,
                      output_tokens_mean=OUTPUT_TOKENS_MEAN, api_key=STUB_KEY,
                      prices={"models": {"gpt-4o": gpt4o}}) as provider:
        yield provider


def _upstreams(stub: StubProvider, directory: Path) -> Path:
    keyed = {"base_url": stub.url, "api_key_env": "STUB_KEY"}
    doc = {"upstreams": [
        # Not named `openai`: `openai/gpt-4o` is the router's own name of the model, and a
        # name may mean one upstream's model only (core/upstreams.py parse).
        {"name": "oai", "api": "openai", **keyed, "base_url": f"{stub.url}/v1",
         "models": ["gpt-4o", "gpt-4o-2024-08-06", "gpt-4o-2024-11-20", "GPT-4o",
                    "gpt-4o-mini"]},
        {"name": "azure-east", "api": "azure", **keyed, "base_url": f"{stub.url}/openai/v1",
         "deployments": {"prod-4o": "gpt-4o"}},
        {"name": "anthropic", "api": "anthropic", **keyed,
         "models": ["claude-haiku-4-5", "claude-haiku-4-5-20251001", "claude-sonnet-4-5"]},
        {"name": "bedrock", "api": "bedrock", "region": REGION, "base_url": stub.url,
         "model_ids": {"claude-haiku-4-5": GLOBAL_HAIKU}},
        {"name": "bedrock-us", "api": "bedrock", "region": REGION, "base_url": stub.url,
         "models": [US_HAIKU]},
        # An OpenAI-compatible router priced by OpenRouter's table, which names gpt-4o
        # `openai/gpt-4o`.
        {"name": "router", "api": "openai", **keyed, "base_url": f"{stub.url}/v1",
         "prices_provider": "openrouter", "models": ["openai/gpt-4o"]},
        {"name": "google", "api": "gemini", **keyed,
         "models": ["gemini-2.5-flash", "gemini-2.5-flash-latest", "gemini-2.5-flash-lite"]},
    ]}
    path = directory / "upstreams.json"
    path.write_text(json.dumps(doc))
    return path


def _gateway(redis_server: RedisServer, stub: StubProvider, directory: Path,
             prices: str) -> ServiceProcess:
    return ServiceProcess({
        "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_UPSTREAM_TIMEOUT_S": "30", "CEILING_PRICES_FILE": prices,
        "CEILING_UPSTREAMS": str(_upstreams(stub, directory)), "STUB_KEY": STUB_KEY,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "CEILING_EXPIRE_POLICY": "release",
    })


@pytest.fixture(scope="module")
def both(redis_server: RedisServer, stub: StubProvider,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, ...]]:
    """Two instances on one Redis: the limits are the ledger's, not an instance's."""
    directory = tmp_path_factory.mktemp("hostile_models")
    prices = write_prices(tmp_path_factory, "hostile_models_prices", {"models": {}})
    with _gateway(redis_server, stub, directory, prices) as gw, \
            _gateway(redis_server, stub, directory, prices) as gw2:
        yield gw, gw2


@pytest.fixture(autouse=True)
def fresh_bill(stub: StubProvider) -> None:
    stub_control(stub.url, {"clock_offset_s": 0, "deployments": {"prod-4o": "gpt-4o"},
                            "bedrock_credentials": {"access_key_id": ACCESS_KEY,
                                                    "secret_access_key": SECRET_KEY,
                                                    "region": REGION}})
    reset_bill(stub.url)


# -- budgets and calls ---------------------------------------------------------------------------


def new_tag() -> str:
    return f"org:m{uuid.uuid4().hex[:10]}"


def put_budget(service: ServiceProcess, budget_id: str, **fields: Any) -> dict[str, Any]:
    body = {"limits": [{"period": "total", "ceiling_micros": ROOMY_MICROS}], **fields}
    r = admin_call(service, "PUT", f"/v1/admin/budgets/{budget_id}", body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def per_model(model: str, ceiling_micros: int) -> dict[str, Any]:
    return {model: {"limits": [{"period": "day", "ceiling_micros": ceiling_micros}]}}


def call_of(route: str, key: str, model: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A call on `route` naming `model`: its path, headers and body."""
    if route == "chat":
        return "/v1/chat/completions", as_key(key), {
            "model": model, "messages": HELLO, "max_tokens": MAX_OUTPUT_TOKENS}
    if route == "responses":
        return "/v1/responses", as_key(key), {
            "model": model, "input": "hello", "max_output_tokens": MAX_OUTPUT_TOKENS}
    if route == "messages":
        return "/v1/messages", {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}, {
            "model": model, "messages": HELLO, "max_tokens": MAX_OUTPUT_TOKENS}
    if route == "gemini":
        return f"/v1beta/models/{model}:generateContent", {"x-goog-api-key": key}, {
            "contents": [{"role": "user", "parts": [{"text": "hello"}]}],
            "generationConfig": {"maxOutputTokens": MAX_OUTPUT_TOKENS, "thinkingConfig": {
                # Flash may think not at all (a hold of its output alone); Flash-Lite at least
                # this much, as the stub has it.
                "thinkingBudget": 512 if "lite" in model else 0}}}
    if route == "count":
        return "/v1/messages/count_tokens", {
            "x-api-key": key, "anthropic-version": ANTHROPIC_VERSION}, {
            "model": model, "messages": HELLO}
    if route == "gemini_count":
        return f"/v1beta/models/{model}:countTokens", {"x-goog-api-key": key}, {
            "contents": [{"role": "user", "parts": [{"text": "hello"}]}]}
    assert route == "reserve"
    return "/v1/reservations", as_key(key), {
        "model": model, "input_tokens": 10, "max_output_tokens": MAX_OUTPUT_TOKENS}


def send(service: ServiceProcess, call: tuple[str, dict[str, Any], dict[str, Any]]
         ) -> httpx.Response:
    path, headers, body = call
    with httpx.Client(base_url=service.url, timeout=30.0, verify=tls_context()) as http:
        return http.post(path, headers=headers, json=body)


def refused_as(answer: httpx.Response) -> str:
    """The code a refusal carries in any of the three error shapes (Google's names it only in
    its message, beside its status)."""
    code = code_of(answer)
    if code.isdigit():
        return str(answer.json()["error"].get("status", code))
    return code


def budget_refused(answer: httpx.Response) -> bool:
    """A budget's refusal (exceeded or busy) in the route's shape: 402/429, or Google's 400
    FAILED_PRECONDITION / 429 RESOURCE_EXHAUSTED."""
    return answer.status_code in (402, 429) or (answer.status_code == 400 and (
        refused_as(answer) == "FAILED_PRECONDITION"))


def error_of(answer: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = answer.json()["error"]
    return error


def reserved_micros(service: ServiceProcess, route: str, key: str, model: str) -> int:
    """What a call of `model` on `route` holds, from a call under a roomy budget of its own."""
    answer = send(service, call_of(route, key, model))
    assert answer.status_code in (200, 201), answer.text
    if route == "reserve":
        return int(answer.json()["reserved_micros"])
    return int(answer.headers["x-ceiling-reserved-micros"])


def counters_now(redis_url: str, tag: str) -> dict[str, int]:
    """Each counter's committed spend in `tag` once the ledger resolved every hold of it."""
    blocking(expire_held(redis_url, tag))
    return counters(redis_url, tag)


def model_counter(redis_url: str, tag: str, model: str) -> dict[str, int]:
    """The model's `day` counter of budget `tag`, as counters_now reads it."""
    return {name: value for name, value in counters_now(redis_url, tag).items()
            if name.startswith(keys.prefix(tag) + keys.COUNTER + f"{tag}/model:{model}|day:")}


# -- a key cannot define what holds it -----------------------------------------------------------


def test_a_key_cannot_put_a_budget_or_its_model_limits(
        both: tuple[ServiceProcess, ...], redis_server: RedisServer) -> None:
    gw = both[0]
    tag = new_tag()
    put_budget(gw, tag, per_model=per_model("gpt-4o", 1_000))
    key = new_key(gw, tag)
    before = unchanged_state(redis_server.url, tag)
    looser = {"limits": [{"period": "total", "ceiling_micros": ROOMY_MICROS}],
              "per_model": per_model("gpt-4o", ROOMY_MICROS)}
    for headers in (as_key(key), {"x-api-key": key}, {"x-goog-api-key": key}):
        with httpx.Client(base_url=gw.url, timeout=10.0, verify=tls_context()) as http:
            for path in (f"/v1/admin/budgets/{tag}", f"/v1/admin/budgets/{tag}/model:gpt-4o"):
                r = http.put(path, headers=headers, json=looser)
                assert r.status_code == 401, r.text
    assert unchanged_state(redis_server.url, tag) == before
    # Nor may an operator name a model's counter as a budget of its own.
    r = admin_call(gw, "PUT", f"/v1/admin/budgets/{tag}/model:gpt-4o", looser)
    assert (r.status_code, code_of(r)) == (422, "invalid_request"), r.text
    assert unchanged_state(redis_server.url, tag) == before


def test_a_budget_names_each_model_by_its_one_name_or_refuses_it(
        both: tuple[ServiceProcess, ...], redis_server: RedisServer) -> None:
    gw = both[0]
    tag = new_tag()
    shown = put_budget(
        gw, tag, models={"allow": ["GPT-4o-2024-08-06", "claude-haiku-4-5-20251001"]},
        per_model={"gpt-4o-2024-11-20": {"limits": [{"period": "day", "ceiling_micros": 5}]}})
    assert shown["models"] == {"allow": ["claude-haiku-4-5", "gpt-4o"]}
    assert list(shown["per_model"]) == ["gpt-4o"]
    before = unchanged_state(redis_server.url, tag)
    for body, field in (({"models": {"allow": ["gpt-4o", "gpt-4o-x"]}}, "models.allow[1]"),
                        ({"per_model": per_model("prod-4o", 5)}, "per_model.prod-4o"),
                        ({"per_model": {**per_model("gpt-4o", 5),
                                        **per_model("gpt-4o-2024-08-06", 9)}},
                         "per_model.gpt-4o-2024-08-06")):
        r = admin_call(gw, "PUT", f"/v1/admin/budgets/{tag}",
                       {"limits": [{"period": "total", "ceiling_micros": 1}], **body})
        assert (r.status_code, code_of(r)) == (422, "invalid_request"), r.text
        assert error_of(r)["field"] == field
        assert unchanged_state(redis_server.url, tag) == before


# -- allow-lists ---------------------------------------------------------------------------------


def test_a_model_the_allow_list_does_not_name_is_refused_before_the_provider(
        both: tuple[ServiceProcess, ...], stub: StubProvider, redis_server: RedisServer) -> None:
    """Every name of gpt-4o passes a list of gpt-4o on both instances; another model, by any
    route, is 403 model_not_allowed naming the budget and the model, never forwarded, and
    changes nothing but the refusal counts."""
    gw, gw2 = both
    org = new_tag()
    team = f"{org}/team:a"
    put_budget(gw, org)
    put_budget(gw, team, models={"allow": ["gpt-4o"]})
    key = new_key(gw, team)
    refused_calls = [("chat", "gpt-4o-mini"), ("responses", "gpt-4o-mini"),
                     ("messages", "claude-haiku-4-5-20251001"), ("messages", GLOBAL_HAIKU),
                     ("messages", "bedrock/claude-haiku-4-5"), ("gemini", "gemini-2.5-flash"),
                     ("reserve", "claude-haiku-4-5"), ("reserve", "gpt-4o-mini-2024-07-18"),
                     # A token count names a model too, which the list does not allow.
                     ("count", "claude-haiku-4-5-20251001"), ("count", GLOBAL_HAIKU),
                     ("gemini_count", "gemini-2.5-flash")]
    before = unchanged_state(redis_server.url, org)
    for i, (route, model) in enumerate(refused_calls):
        answer = send(both[i % 2], call_of(route, key, model))
        assert answer.status_code == 403, (route, model, answer.text)
        assert "model_not_allowed" in answer.text or refused_as(answer) == "PERMISSION_DENIED"
        assert team in answer.text, answer.text
    assert fetch_bill(stub.url).requests == 0, "a refused call reached the provider"
    assert unchanged_state(redis_server.url, org) == before
    allowed = [("chat", m) for m in GPT4O_NAMES] + [("responses", "gpt-4o-2024-08-06"),
                                                     ("reserve", "GPT-4o")]
    for i, (route, model) in enumerate(allowed):
        answer = send((gw, gw2)[i % 2], call_of(route, key, model))
        assert answer.status_code in (200, 201), (route, model, answer.text)
    # A name of its own past the model's is no name of it: refused before anything is held.
    for route, model in (("chat", "gpt-4o-x"), ("chat", "gpt-4o-2024-08-06-x"),
                         ("reserve", "gpt-4o-x"), ("reserve", "gpt-4o:free")):
        answer = send(gw, call_of(route, key, model))
        assert answer.status_code in (400, 403, 422), answer.text


# -- per-model limits ----------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["chat", "responses", "messages", "gemini"])
def test_two_instances_hold_a_models_limit_by_the_bill_under_every_name_of_it(
        both: tuple[ServiceProcess, ...], stub: StubProvider, redis_server: RedisServer,
        route: str) -> None:
    """Calls under every name of the model, alternating between the instances, until one is
    refused, naming the model's counter; refused again on the other instance before the stub
    sees anything; then each name until it too is refused (a name whose upstream prices it
    lower may still fit the room left). What the stub billed for them all is within the
    model's ceiling and is what the model's counter holds, and the budget itself still serves
    another model."""
    gw, gw2 = both
    one_name, names = ONE_NAME[route], NAMES[route]
    probe = new_tag()
    put_budget(gw, probe)
    hold = reserved_micros(gw, route, new_key(gw, probe), names[0])
    tag = new_tag()
    ceiling = 3 * hold + hold // 2
    put_budget(gw, tag, per_model=per_model(one_name, ceiling))
    key = new_key(gw, tag)
    reset_bill(stub.url)

    answers = []
    for i in range(CALLS_MAX):
        answer = send((gw, gw2)[i % 2], call_of(route, key, names[i % len(names)]))
        answers.append(answer)
        if answer.status_code != 200:
            break
    refusal = answers[-1]
    assert budget_refused(refusal), refusal.text
    assert f"{tag}/model:{one_name}" in refusal.text, refusal.text
    assert len(answers) - 1 >= 3
    refused_name = names[(len(answers) - 1) % len(names)]
    requests = fetch_bill(stub.url).requests
    assert budget_refused(send((gw2, gw)[(len(answers) - 1) % 2],
                               call_of(route, key, refused_name)))
    assert fetch_bill(stub.url).requests == requests, "a refused call reached the provider"
    for i, model in enumerate(names):
        for _ in range(CALLS_MAX):
            answer = send((gw, gw2)[i % 2], call_of(route, key, model))
            answers.append(answer)
            if budget_refused(answer):
                break
            assert answer.status_code == 200, answer.text
        assert budget_refused(answers[-1]), model
    bill = fetch_bill(stub.url)
    admitted = [a for a in answers if a.status_code == 200]
    assert bill.total.calls == len(admitted)
    assert bill.total.cost_micros <= ceiling
    (committed,) = model_counter(redis_server.url, tag, one_name).values()
    assert committed == bill.total.cost_micros
    assert counters_now(redis_server.url, tag)[keys.counter(tag, tag, "total")] == (
        bill.total.cost_micros)
    print(f"\nhostile | models: {route} under {len(names)} names | admitted {len(admitted)} | "
          f"ceiling {ceiling} | billed {bill.total.cost_micros}")
    other = {"chat": "gpt-4o-mini", "responses": "gpt-4o-mini",
             "messages": "claude-sonnet-4-5", "gemini": "gemini-2.5-flash-lite"}[route]
    served = send(gw2, call_of(route, key, other))
    assert served.status_code == 200, served.text


def test_fifty_concurrent_reservations_admit_exactly_what_the_models_ceiling_holds(
        both: tuple[ServiceProcess, ...], redis_server: RedisServer) -> None:
    """Sidecar holds stay open until settled: 50 at once, under gpt-4o's names, spread over
    both instances, against a ceiling of room for 7: exactly 7 admitted, the others refused
    naming the model's counter, which holds exactly 7 holds."""
    gw, gw2 = both
    probe = new_tag()
    put_budget(gw, probe)
    hold = reserved_micros(gw, "reserve", new_key(gw, probe), "gpt-4o")
    tag = new_tag()
    put_budget(gw, tag, per_model=per_model("gpt-4o", 8 * hold - 1))
    key = new_key(gw, tag)
    names = ("gpt-4o", "gpt-4o-2024-08-06", "GPT-4o", "gpt-4o-2024-11-20")
    calls = [((gw, gw2)[i % 2], call_of("reserve", key, names[i % len(names)]))
             for i in range(50)]
    answers = blocking(send_all(calls, 50))
    admitted = [a for a in answers if a.status_code == 201]
    assert len(admitted) == 7, [a.text[:120] for a in answers if a.status_code != 201][:3]
    for answer in answers:
        if answer.status_code != 201:
            assert code_of(answer) in ("budget_busy", "budget_exceeded"), answer.text
            assert error_of(answer)["budget_id"] == f"{tag}/model:gpt-4o"
    legs = blocking(_status(redis_server.url, tag))
    assert legs == {"day": 7 * hold}
    # The key sees what holds it: its model's counter among its budgets.
    with httpx.Client(base_url=gw2.url, timeout=10.0, verify=tls_context()) as http:
        mine = http.get("/v1/budgets/me", headers=as_key(key)).json()["budgets"]
    assert [(b["budget_id"], b["reserved_micros"]) for b in mine
            if b["budget_id"] == f"{tag}/model:gpt-4o"] == [(f"{tag}/model:gpt-4o", 7 * hold)]


async def _status(redis_url: str, tag: str) -> dict[str, int]:
    from core.stores.redis import RedisStore

    store = RedisStore(redis_url)
    try:
        legs = await store.status((BudgetId(tag),), None, None, "gpt-4o")
    finally:
        await store.close()
    return {leg.period.value: leg.reserved_micros for leg in legs
            if leg.budget_id == f"{tag}/model:gpt-4o"}


def test_concurrent_calls_through_the_gateway_stay_within_the_models_ceiling(
        both: tuple[ServiceProcess, ...], stub: StubProvider, redis_server: RedisServer) -> None:
    """Gateway calls at once under every name, on both instances: the stub's bill for the model
    stays within its ceiling."""
    gw, gw2 = both
    probe = new_tag()
    put_budget(gw, probe)
    hold = reserved_micros(gw, "chat", new_key(gw, probe), "gpt-4o")
    tag = new_tag()
    ceiling = 5 * hold + hold // 3
    put_budget(gw, tag, per_model=per_model("gpt-4o", ceiling))
    key = new_key(gw, tag)
    reset_bill(stub.url)
    calls = [((gw, gw2)[i % 2], call_of("chat", key, GPT4O_NAMES[i % len(GPT4O_NAMES)]))
             for i in range(24)]
    answers = blocking(send_all(calls, 24))
    bill = fetch_bill(stub.url)
    # At least the five holds that fit at once; more once settled calls give back what their
    # bills did not use.
    assert 5 <= bill.total.calls == sum(a.status_code == 200 for a in answers)
    assert bill.total.cost_micros <= ceiling
    assert all(a.status_code == 200 or budget_refused(a) for a in answers)
    (committed,) = model_counter(redis_server.url, tag, "gpt-4o").values()
    assert committed == bill.total.cost_micros
