"""Claude on Amazon Bedrock and on Google Vertex AI, through POST /v1/messages, tried as a hostile
key holder would, judged by the stub's bill (issue 37).

The gateway's CEILING_UPSTREAMS routes Claude to the stub provider's Bedrock runtime
(infra/stub_bedrock.py: SigV4 verified, its event-stream framing) and to its Vertex AI
(infra/stub_vertex.py: a service account's OAuth token). Each attack is sent with the real
`anthropic` SDK, against a small ceiling, until the ceiling would have been passed several times
over if the hole were open, and judged as every hostile suite is (tests/api/hostile.py): the
bill within the ceiling, committed at least the bill, nothing left held, and where the test says
so every call billed at most its hold and the books equal to the bill to the micro-dollar. An
attack refused before anything is held is judged by the stub's request count: nothing reached it.

Prices are independent on the two sides: the gateway holds Bedrock's Claude at genai-prices'
'aws' table (a global profile at its rates, any other id at the regional ones) and Vertex's at
Google's; the stub bills from its own table (infra/stub_prices.json). The stub answers every
call to its output cap, so a call's bill is near its hold and a hole shows in the bill.

Which of Anthropic's server tools each cloud offers: Vertex AI runs web search (billed per
search, as Anthropic bills it); neither runs web fetch or code execution, and Bedrock runs none
of the three. The stubs refuse what their cloud does not run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from api.upstream import UPSTREAM_ANSWER_BYTES_MAX
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill
from tests.api.clouds import bedrock, cloud_gateway, trust_the_key_pair, vertex
from tests.api.conftest import Client, account, anthropic_sdk, client_for, ledger
from tests.api.hostile import Attack, control, judge, refusal_code, streamed
from tests.support import write_prices

# Each attack drives real gateway processes and the SDK until the ceiling would have been
# passed several times over: outside the dev loop, as the other hostile batteries are.
pytestmark = pytest.mark.slow

US_SONNET = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
EU_SONNET = "eu.anthropic.claude-sonnet-4-5-20250929-v1:0"
GLOBAL_HAIKU = "global.anthropic.claude-haiku-4-5-20251001-v1:0"
GLOBAL_OPUS_55 = "global.anthropic.claude-opus-5-5"
# Claude Opus 4.5 by its US profile and dated id, as Bedrock lists it: the stub's table bills it
# ($5.50 / $27.50), the gateway's 'aws' table names it without the date, so it is refused
# before anything is held rather than priced by a guess.
US_OPUS_45 = "us.anthropic.claude-opus-4-5-20251101-v1:0"
VERTEX_SONNET, VERTEX_HAIKU = "claude-sonnet-4-5@20250929", "claude-haiku-4-5@20251001"
OPUS_55 = "claude-opus-5-5"  # Claude Code's default: adaptive thinking
# The model each cloud's attacks call, and Claude Opus 5.5 (adaptive thinking) by its prefix:
# both clouds serve it, so the bare name is refused until the call says which.
SONNET = {"bedrock": "bedrock/claude-sonnet-4-5", "vertex": VERTEX_SONNET}
OPUS = {"bedrock": f"bedrock/{OPUS_55}", "vertex": f"vertex/{OPUS_55}"}
CLOUDS = tuple(SONNET)
# The stub's Bedrock and Vertex APIs on its bill.
BILLED_APIS = {"bedrock": "bedrock.invoke", "vertex": "vertex.messages"}
# Far above any output cap here: every answer runs to its cap.
OUTPUT_TOKENS_MEAN = 1_000_000
HOSTILE_ENV = {"CEILING_EXPIRE_POLICY": "release"}
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
# Claude Haiku 4.5 at a regional Vertex endpoint: Anthropic's rates and 10%, which the operator
# names in the prices file (no bundled table has them: core/upstreams.py price_key).
REGIONAL_HAIKU_PRICES = {"input_usd_per_mtok": "1.10", "output_usd_per_mtok": "5.50",
                         "cached_input_usd_per_mtok": "0.11", "cache_write_usd_per_mtok": "1.375",
                         "cache_write_1h_usd_per_mtok": "2.20"}
# An operator who prices web search for Claude Haiku 4.5's global Bedrock profile in the prices
# file (the 'aws' table's rates, and a search's): the gateway then holds a search there, and
# Bedrock, which runs none, refuses the call unbilled.
OPERATOR_PRICED_SEARCH = "global.anthropic.claude-haiku-4-5-20251001-v1:0"
OPERATOR_SEARCH_PRICES = {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "5.00",
                          "cached_input_usd_per_mtok": "0.10", "cache_write_usd_per_mtok": "1.25",
                          "cache_write_1h_usd_per_mtok": "2.00", "usd_per_web_search": "0.01",
                          "web_search_result_tokens_max": 2_000}
INTERLEAVED = {"anthropic-beta": "interleaved-thinking-2025-05-14"}


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=37, latency_ms_min=0, latency_ms_max=2,
                      output_tokens_mean=OUTPUT_TOKENS_MEAN) as provider:
        yield provider


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, stub: StubProvider,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    directory = tmp_path_factory.mktemp("hostile_cloud")
    prices = write_prices(tmp_path_factory, "hostile_cloud_prices", {"models": {
        OPERATOR_PRICED_SEARCH: OPERATOR_SEARCH_PRICES,
        "regional.claude-haiku-4-5-20251001": REGIONAL_HAIKU_PRICES}})
    upstreams = [
        bedrock(stub, "bedrock", {"claude-sonnet-4-5": US_SONNET, "claude-haiku-4-5": GLOBAL_HAIKU,
                                  OPUS_55: GLOBAL_OPUS_55, "claude-opus-4-5": US_OPUS_45}),
        bedrock(stub, "bedrock-eu", {"claude-sonnet-4-5": EU_SONNET}),
        vertex(stub, directory, "vertex", "global", [VERTEX_SONNET, VERTEX_HAIKU, OPUS_55]),
        vertex(stub, directory, "vertex-east", "us-east5", [VERTEX_HAIKU, OPUS_55]),
    ]
    env = {"CEILING_UPSTREAM_TIMEOUT_S": "30", **HOSTILE_ENV}
    with cloud_gateway(redis_server, prices, directory, upstreams, env) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_provider(stub: StubProvider) -> Iterator[None]:
    """Each attack is judged by its own bill: a new one, no faults."""
    trust_the_key_pair(stub)
    reset_bill(stub.url)
    yield
    trust_the_key_pair(stub)


def nothing_reached_the_provider(stub: StubProvider) -> None:
    assert fetch_bill(stub.url).requests == 0


def refused(create: Any, code: str, status: int, **request: Any) -> dict[str, Any]:
    """The call is refused by the gateway with `code`, nothing held; its error body."""
    with pytest.raises(anthropic.APIStatusError) as caught:
        create(**request)
    assert (caught.value.status_code, refusal_code(caught.value)) == (status, code), (
        caught.value.body)
    assert caught.value.response.headers.get("x-ceiling-reserved-micros", "0") == "0"
    error = caught.value.body["error"]  # type: ignore[index]
    assert isinstance(error, dict)
    return error


# -- thinking -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", CLOUDS)
def test_thinking_budgets_and_adaptive_thinking_are_held(
    cloud: str, gw: ServiceProcess, admin: Client, stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """A thinking budget above max_tokens (the interleaved-thinking beta lets a provider take
    one) is refused, naming the budget; budgets inside it and adaptive thinking (Claude Opus
    5.5, whose thinking only max_tokens bounds) are held at max_tokens and billed, thinking
    included, at most their hold."""
    ceiling = 150_000  # 2,000 out at $15-$22 a million: 30,000-44,000 a call, ~4 calls
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    for budget in (2_001, 64_000):
        error = refused(messages.create, "input_unbounded", 422, model=SONNET[cloud],
                        max_tokens=2_000, messages=HELLO, extra_headers=INTERLEAVED,
                        thinking={"type": "enabled", "budget_tokens": budget})
        assert error["field"] == "thinking.budget_tokens"
    nothing_reached_the_provider(stub)
    attack = Attack(f"{cloud}: thinking budgets and adaptive thinking")
    for i in range(12):  # ~3x the ceiling
        if i % 2:
            attack.send(messages.with_raw_response.create, model=OPUS[cloud], max_tokens=2_000,
                        messages=HELLO, thinking={"type": "adaptive"}, stream=i % 4 == 3)
        else:
            attack.send(messages.with_raw_response.create, model=SONNET[cloud],
                        max_tokens=2_000, messages=HELLO, extra_headers=INTERLEAVED,
                        thinking={"type": "enabled", "budget_tokens": 1_500})
    assert attack.refusals["budget_exceeded"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert verdict.bill.total.reasoning_tokens > 0
    assert {c.api for c in verdict.bill.log} == {BILLED_APIS[cloud]}


# -- server tools -------------------------------------------------------------------------------

WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search"}
WEB_FETCH = {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 1}
CODE_EXECUTION = {"type": "code_execution_20250825", "name": "code_execution"}


SEARCH_RESULT_TOKENS = 2_000


@pytest.mark.parametrize("cloud", CLOUDS)
def test_server_tools_are_held_at_max_uses_or_refused(
    cloud: str, gw: ServiceProcess, admin: Client, stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """Web fetch and code execution feed the model input (or bill container time) nothing in
    the request bounds: refused on both clouds, naming the tool. Web search on Bedrock, which
    the 'aws' table prices no search for, is refused naming the prices file's setting (priced
    there by an operator, it is held, and Bedrock refuses it unbilled: released); on Vertex,
    which runs it, a call is held at max_uses searches, or at the gateway's own
    max_uses, which it sends (and says so), while the model would search 5 times a call."""
    ceiling = 30_000_000  # a search is held at the context window's input: ~$2.3 each
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    for tool in (WEB_FETCH, CODE_EXECUTION):
        error = refused(messages.create, "input_unbounded", 422, model=SONNET[cloud],
                        max_tokens=64, messages=HELLO, tools=[tool])
        assert error["field"] == "tools[0]"
    if cloud == "bedrock":
        for tool in (WEB_SEARCH, {**WEB_SEARCH, "max_uses": 1}):
            error = refused(messages.create, "model_unpriced", 422, model=SONNET[cloud],
                            max_tokens=64, messages=HELLO, tools=[tool])
            assert "usd_per_web_search" in error["message"]
        nothing_reached_the_provider(stub)
        attack = Attack(f"{cloud}: web search the operator priced, which Bedrock does not run")
        for i in range(4):
            attack.send(messages.with_raw_response.create, model="claude-haiku-4-5",
                        max_tokens=64, messages=HELLO, tools=[{**WEB_SEARCH, "max_uses": 1}],
                        stream=i % 2 == 1)
        assert attack.refusals["400"] == 4  # Bedrock's refusal, relayed: released
        verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True)
        assert [(c.status, c.billed) for c in verdict.bill.log] == [(400, False)] * 4
        return
    nothing_reached_the_provider(stub)
    control(stub, web_searches=5, web_search_result_tokens=SEARCH_RESULT_TOKENS)
    attack = Attack(f"{cloud}: web searches past max_uses, or with none given")
    for i in range(9):
        tool = WEB_SEARCH if i % 3 == 0 else {**WEB_SEARCH, "max_uses": i % 3}
        raw = attack.send(messages.with_raw_response.create, model=SONNET[cloud],
                          max_tokens=64, messages=HELLO, tools=[tool], stream=i % 2 == 1)
        if raw is not None and tool is WEB_SEARCH:
            assert raw.headers["x-ceiling-bounds-added"] == "tools[0].max_uses=5"
        if raw is not None and i % 2:
            assert streamed(raw)
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    searches = [c.usage.web_search_requests for c in verdict.bill.log if c.usage is not None]
    assert len(searches) == 9
    assert searches == [5 if i % 3 == 0 else i % 3 for i in range(9)]


# -- fields and betas ----------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", CLOUDS)
def test_unknown_fields_and_betas_are_refused_and_nothing_is_forwarded(
    cloud: str, gw: ServiceProcess, admin: Client, stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """A cloud's own envelope smuggled in the body (`anthropic_beta`, `anthropic_version`: a
    beta the gateway never checked), fields the gateway does not know, Anthropic's fast mode,
    and betas it does not know are refused by name before anything is held. A beta the gateway
    knows bills nothing beyond the hold but the cloud does not take is left out, and the call
    is held and billed as any other (api/upstreams/cloud_messages.py)."""
    ceiling = 100_000
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    smuggled: list[dict[str, Any]] = [
        {"anthropic_beta": ["context-1m-2025-08-07"]},
        {"anthropic_version": "bedrock-2023-05-31"},
        {"speed": "fast"}, {"inference_geo": "us"}, {"model_id": US_SONNET},
        {"mcp_servers": [{"type": "url", "url": "https://mcp.hostile.test", "name": "x"}]},
    ]
    for extra in smuggled:
        error = refused(messages.create, "field_unsupported", 422, model=SONNET[cloud],
                        max_tokens=64, messages=HELLO, extra_body=extra)
        assert error["field"] == next(iter(extra)), error
    for beta in ("fast-mode-2026-02-01", "betas-of-tomorrow", "oauth-2025-04-20"):
        error = refused(messages.create, "input_unbounded", 422, model=SONNET[cloud],
                        max_tokens=64, messages=HELLO, extra_headers={"anthropic-beta": beta})
        assert error["field"] == "anthropic-beta"
    nothing_reached_the_provider(stub)
    attack = Attack(f"{cloud}: betas the cloud does not take, beside those it does")
    betas = ("prompt-caching-scope-2026-01-05,interleaved-thinking-2025-05-14,"
             "thinking-token-count-2026-05-13,advanced-tool-use-2025-11-20")
    for i in range(8):  # 2,000 out at $15-$16.50 a million: ~33,000 a call, ~3 calls' worth
        attack.send(messages.with_raw_response.create, model=SONNET[cloud], max_tokens=2_000,
                    messages=HELLO, extra_headers={"anthropic-beta": betas},
                    stream=i % 2 == 1)
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert [c.status for c in verdict.bill.log] == [200] * len(attack.forwarded) != []


# -- a second gateway: the envelope let through, Gemini beside Claude on Vertex -----------------

# An operator's setting that lets the cloud's own envelope fields through the Messages route's
# allow-list (CEILING_GATEWAY_FIELDS_ALLOWED): they reach the cloud's client, which must still
# send no beta the gateway did not check.
ENVELOPE_ALLOWED = {"CEILING_GATEWAY_FIELDS_ALLOWED": "anthropic_beta,anthropic_version"}
# Above the 200K tokens a Claude call is billed at its long-context rates past, by the stub's
# count (UTF-8 bytes over four): ~210,000 tokens.
LONG_PROMPT = "hello " * 140_000
VERTEX_GEMINI = "gemini-2.5-flash"
GEMINI_HELLO = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}],
                "generationConfig": {"maxOutputTokens": 64}}


@pytest.fixture(scope="module")
def gw2(redis_server: RedisServer, stub: StubProvider,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A gateway that lets the envelope fields through, its Vertex serving Gemini and Claude."""
    directory = tmp_path_factory.mktemp("hostile_cloud_gw2")
    prices = write_prices(tmp_path_factory, "hostile_cloud_gw2_prices", {"models": {}})
    upstreams = [bedrock(stub, "bedrock", {"claude-sonnet-4-5": US_SONNET}),
                 vertex(stub, directory, "vertex", "global",
                        [VERTEX_SONNET, OPUS_55, VERTEX_GEMINI])]
    env = {"CEILING_UPSTREAM_TIMEOUT_S": "30", **HOSTILE_ENV, **ENVELOPE_ALLOWED}
    with cloud_gateway(redis_server, prices, directory, upstreams, env) as service:
        yield service


@pytest.mark.parametrize("cloud", CLOUDS)
def test_betas_in_the_body_never_reach_the_cloud(
    cloud: str, gw2: ServiceProcess, admin: Client, stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """With `anthropic_beta` let through by the operator, a client's body list is still not
    what the cloud gets: the gateway checks and prices betas from the `anthropic-beta` header
    only. The 1M-context beta in the body with a prompt past 200K tokens (held at the flat
    rates) reaches the cloud without it, which refuses the prompt unbilled rather than billing
    it at its long-context rates (which, had the beta reached it, the stub's log would show as
    a call billed); a beta the gateway never checked, in the body, reaches neither
    cloud (Bedrock fails a call naming one it does not take, Vertex one with the body field)."""
    # The long call is held at the gateway's bound on its input (a token a byte, up to $6 a
    # million on Google's table: ~5,000,000), the small ones at ~1,100.
    ceiling = 8_000_000
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw2, key).messages
    attack = Attack(f"{cloud}: betas in the body")
    attack.send(messages.with_raw_response.create, model=SONNET[cloud], max_tokens=64,
                messages=[{"role": "user", "content": LONG_PROMPT}],
                extra_body={"anthropic_beta": ["context-1m-2025-08-07"]})
    for envelope in ({"anthropic_beta": ["betas-of-tomorrow"]},
                     {"anthropic_beta": ["context-1m-2025-08-07"],
                      "anthropic_version": "2023-01-01"}):
        attack.send(messages.with_raw_response.create, model=SONNET[cloud], max_tokens=64,
                    messages=HELLO, extra_body=envelope)
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert [(c.status, c.billed) for c in verdict.bill.log] == [
        (400, False), (200, True), (200, True)]


def test_vertex_serves_claude_on_messages_and_gemini_on_gemini_only(
    gw2: ServiceProcess, admin: Client, stub: StubProvider,
) -> None:
    """One Vertex upstream serves Claude (Anthropic's publisher path) and Gemini (Google's):
    a Gemini model on the Messages route, or Claude on Gemini's, is refused model_not_routed,
    naming the model and the route that serves it, before anything is held or forwarded (else
    it would be held, then sent to the other publisher's path). Each on its own route is
    served."""
    tag, key = account(admin, 1_000_000)
    messages = anthropic_sdk(gw2, key).messages
    for model in (VERTEX_GEMINI, f"vertex/{VERTEX_GEMINI}"):
        error = refused(messages.create, "model_not_routed", 400, model=model, max_tokens=64,
                        messages=HELLO)
        assert VERTEX_GEMINI in error["message"], error
        assert "the gemini route" in error["message"], error
    with client_for(gw2) as client:
        # The Gemini route's model ids are Google's ([a-z0-9._-]): Claude by a name without a
        # date (a Vertex name's `@` is refused by the route itself).
        r = client.post(f"/v1beta/models/{OPUS_55}:generateContent",
                        headers={"x-goog-api-key": key}, json=GEMINI_HELLO)
        error = r.json()["error"]
        assert r.status_code == 400, r.text
        assert error["details"][0]["reason"] == "model_not_routed", r.text
        assert OPUS_55 in error["message"], r.text
        assert "the messages route" in error["message"], r.text
        nothing_reached_the_provider(stub)
        assert ledger(admin, tag)["reserved_micros"] == 0
        messages.create(model=VERTEX_SONNET, max_tokens=64, messages=HELLO)
        r = client.post(f"/v1beta/models/{VERTEX_GEMINI}:generateContent",
                        headers={"x-goog-api-key": key}, json=GEMINI_HELLO)
        assert r.status_code == 200, r.text
    assert [(c.api, c.status) for c in fetch_bill(stub.url).log] == [
        ("vertex.messages", 200), ("vertex.gemini", 200)]


# -- token counts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", CLOUDS)
def test_a_count_on_either_cloud_holds_nothing_and_bills_nothing(
    cloud: str, gw: ServiceProcess, admin: Client, stub: StubProvider,
) -> None:
    """count_tokens goes to the model's cloud (Bedrock's CountTokens, Vertex's
    count-tokens:rawPredict) and holds nothing, as the cloud bills nothing; one that smuggles a
    field or an unknown beta is refused before it is forwarded. Counted with a beta the cloud
    does not take, it is counted without it."""
    tag, key = account(admin, 1_000)
    messages = anthropic_sdk(gw, key).messages
    refused(messages.count_tokens, "field_unsupported", 422, model=SONNET[cloud],
            messages=HELLO, extra_body={"anthropic_beta": ["context-1m-2025-08-07"]})
    refused(messages.count_tokens, "input_unbounded", 422, model=SONNET[cloud],
            messages=HELLO, extra_headers={"anthropic-beta": "betas-of-tomorrow"})
    nothing_reached_the_provider(stub)
    counts = [messages.count_tokens(model=SONNET[cloud], messages=HELLO, extra_headers=headers)
              for headers in ({}, {"anthropic-beta": "prompt-caching-scope-2026-01-05,"
                                                     "context-management-2025-06-27"})]
    assert counts[0].input_tokens == counts[1].input_tokens > 0
    bill = fetch_bill(stub.url)
    assert [(c.status, c.billed) for c in bill.log] == [(200, False)] * 2
    assert bill.total.cost_micros == 0
    books = ledger(admin, tag)
    assert (books["committed_micros"], books["reserved_micros"]) == (0, 0)


# -- model names ----------------------------------------------------------------------------------

# Names that reach no upstream: another upstream's name under a prefix, a cloud's id of a model
# no upstream lists, cross-region profiles the operator did not configure, case variants, a
# prefix with nothing after it. Each is refused model_not_routed before anything is held.
NAMES_NOT_ROUTED = (
    f"vertex/{US_SONNET}", "bedrock/" + VERTEX_SONNET, "vertex/claude-sonnet-4-5",
    "bedrock-eu/claude-haiku-4-5", "anthropic/claude-sonnet-4-5", "bedrock/",
    "global.anthropic.claude-sonnet-4-5-20250929-v1:0",
    "apac.anthropic.claude-sonnet-4-5-20250929-v1:0",
    "anthropic.claude-sonnet-4-5-20250929-v1:0", "anthropic.claude-3-haiku-20240307-v1:0",
    "Claude-Sonnet-4-5", "bedrock/CLAUDE-SONNET-4-5", US_SONNET.upper(),
    "Claude-Sonnet-4-5@20250929", "claude-opus-5-5", "claude-sonnet-4-5", VERTEX_HAIKU,
    "bedrock//claude-sonnet-4-5",
)


def test_model_name_tricks_reach_no_cloud_unheld(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """Every name no upstream serves is refused, nothing held or forwarded (a name two
    upstreams serve, claude-opus-5-5, claude-sonnet-4-5 and Vertex's Haiku, until the call says
    which). A Bedrock id the 'aws' table does not price (Claude Opus 4.5's dated id, which the
    cloud bills) is refused model_unpriced, whichever name it is called by; so is Claude Opus
    5.5 at a regional Vertex endpoint, billed 10% above the global rate no bundled table has.
    The names that do route, by prefix, by the configured Bedrock id itself, by each configured
    profile (US, EU, global) and at a regional Vertex endpoint the prices file prices, are held
    at their own rates and billed at most that."""
    ceiling = 60_000
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    for name in NAMES_NOT_ROUTED:
        refused(messages.create, "model_not_routed", 400, model=name, max_tokens=64,
                messages=HELLO)
    for name, priced_as in (("bedrock/claude-opus-4-5", US_OPUS_45), (US_OPUS_45, US_OPUS_45),
                            ("vertex-east/claude-opus-5-5", "regional.claude-opus-5-5")):
        error = refused(messages.create, "model_unpriced", 422, model=name, max_tokens=64,
                        messages=HELLO)
        assert priced_as.removeprefix("us.anthropic.") in error["message"], error
    nothing_reached_the_provider(stub)
    routed = (f"vertex-east/{VERTEX_HAIKU}", "bedrock/claude-sonnet-4-5", US_SONNET,
              "bedrock-eu/claude-sonnet-4-5", EU_SONNET, "claude-haiku-4-5", GLOBAL_HAIKU,
              "bedrock/claude-opus-5-5", f"vertex/{VERTEX_HAIKU}", "vertex/claude-opus-5-5")
    attack = Attack("clouds: model names by prefix, by Bedrock id and by profile")
    for i in range(18):  # 500 out at up to $22 a million: ~11,000 a call, ~5 calls' worth
        attack.send(messages.with_raw_response.create, model=routed[i % len(routed)],
                    max_tokens=500, messages=HELLO)
    assert attack.refusals["budget_exceeded"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert all(c.status == 200 for c in verdict.bill.log)
    # The regional endpoint's call was billed its premium, inside the prices file's hold.
    assert any("regional_premium_micros" in (c.beyond_body or {}) for c in verdict.bill.log)


# -- streams and answers --------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", CLOUDS)
def test_a_stream_cut_midway_stays_held(
    cloud: str, gw: ServiceProcess, admin: Client, stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """Billed, then cut off after message_start, after the last delta, or failed after
    billing (Bedrock's exception frame, Vertex's error event): none reached message_stop, so
    each keeps its hold as unknown, and expiry charges it."""
    ceiling = 25_000
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    faults: list[dict[str, Any]] = [{"break_after_events": 2}, {"break_after_events": 99},
                                    {"fail_after_billing": 503}, {}]
    attack = Attack(f"{cloud}: streams cut off")
    complete = 0
    for i in range(12):
        control(stub, **faults[i % len(faults)], calls=1)
        raw = attack.send(messages.with_raw_response.create, model=SONNET[cloud],
                          max_tokens=200, messages=HELLO, stream=True)
        if raw is not None:
            complete += streamed(raw)
    assert attack.refusals["budget_busy"] + attack.refusals["budget_exceeded"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, per_call=True)
    assert 0 < complete < verdict.provider_calls
    # A cut stream was billed in full and kept held: expiry charged the hold, at least the bill.
    assert verdict.committed_micros > verdict.billed_micros


@pytest.mark.parametrize("cloud", CLOUDS)
def test_an_answer_larger_than_the_gateway_reads_stays_held(
    cloud: str, gw: ServiceProcess, admin: Client, stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """The cloud answers more than the gateway reads of an answer that is not streamed: the
    call was billed and its usage left unread, so its hold stays and expiry charges it."""
    ceiling = 30_000
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    control(stub, answer_padding_bytes=UPSTREAM_ANSWER_BYTES_MAX + 1024 * 1024)
    attack = Attack(f"{cloud}: answers past the gateway's bound")
    for _ in range(4):  # 500 out at $15 a million: ~8,000 held a call
        attack.send(messages.with_raw_response.create, model=SONNET[cloud], max_tokens=500,
                    messages=HELLO)
    assert attack.refusals["upstream_answer_too_large"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, per_call=True)
    assert verdict.provider_calls == attack.refusals["upstream_answer_too_large"]
    assert verdict.committed_micros >= verdict.billed_micros > 0
