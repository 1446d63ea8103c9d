"""Every route of the OpenAPI schema, fuzzed by schemathesis over real HTTP, the gateway's with an
upstream: the stub provider (its OpenAI and Anthropic routes), the witness of what was billed.

After every case: no 5xx came from the service itself (a provider's error relayed is the
provider's), and the ledger's invariant holds for both fuzzed budgets. At the end: the gateway
reached the provider on each of its routes, and its budget holds at least what the provider
billed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill
from tests.api.conftest import ADMIN_TOKEN, client_for

# Enough cases per operation to reach every validation branch, few enough for CI's budget.
CASES_PER_OPERATION = 40
# Gemini's routes name their model in the path, under either version.
GEMINI_PATHS = frozenset(f"/{version}/models/{{model}}:{method}" for version in ("v1beta", "v1")
                         for method in ("generateContent", "streamGenerateContent",
                                        "countTokens"))
GATEWAY_PATHS = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/messages",
                           "/v1/embeddings", *GEMINI_PATHS})
# The models the fuzzed gateway calls are sent with (when a case's own random name is not kept),
# one for OpenAI's routes and one for Anthropic's, priced the same by the service and the stub:
# one micro-dollar an input token, four an output.
MODEL = "fuzz-m1"
CLAUDE_MODEL = "fuzz-c1"
EMBEDDING_MODEL = "fuzz-e1"  # the embeddings route's: an input rate only
GEMINI_MODEL = "fuzz-g1"  # Gemini's, on a `gemini` upstream of CEILING_UPSTREAMS
RATES = {"input_usd_per_mtok": "1.00", "output_usd_per_mtok": "4.00"}
EMBEDDING_RATES = {"input_usd_per_mtok": "1.00"}
# The stub serves a model by the embeddings API when its entry says how.
STUB_EMBEDDING = {**EMBEDDING_RATES, "output_usd_per_mtok": "0", "embedding": {
    "dimensions": 64, "dimensions_settable": True, "input_tokens_max": 8_192}}
# The stub serves a model by Anthropic's API when its entry says how (infra/stub_prices.py).
STUB_CLAUDE = {**RATES, "anthropic": {
    "context_window_tokens": 200_000, "output_tokens_max": 64_000, "cache_tokens_min": 1_024,
    "tool_prompt_tokens": {"auto": 346, "any": 313}, "keeps_thinking": False}}
# The stub serves a model by the Gemini API when its entry says how; it thinks not at all, so
# the gateway holds no thinking for a call whose thinkingBudget is 0.
STUB_GEMINI = {**RATES, "context_window_tokens": 100_000, "gemini": {
    "output_tokens_max": 8_192, "thinking": "none", "thinking_budget_min": 0,
    "thinking_budget_max": 0, "thinks_by_default": False, "grounding_usd_per_1k": "35",
    "grounding_per": "prompt"}}
API_VERSION = "2023-06-01"
# The gateway's cap for a call that sets none, and the stub's short answers: many calls fit.
OUTPUT_TOKENS_DEFAULT = 64
GATEWAY_CEILING_MICROS = 400_000
SIDECAR_CEILING_MICROS = 50_000
# Billed calls the run must show on each gateway route, or it did not reach the provider.
BILLED_CALLS_MIN = 5


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=13, latency_ms_min=0, latency_ms_max=2, output_tokens_mean=20,
                      prices={"models": {MODEL: RATES, CLAUDE_MODEL: STUB_CLAUDE,
                                         EMBEDDING_MODEL: STUB_EMBEDDING,
                                         GEMINI_MODEL: STUB_GEMINI}}) as provider:
        yield provider


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer, stub: StubProvider,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    prices = Path(tmp_path_factory.mktemp("fuzz")) / "prices.json"
    prices.write_text(json.dumps({"models": {MODEL: RATES, CLAUDE_MODEL: RATES,
                                             EMBEDDING_MODEL: EMBEDDING_RATES,
                                             GEMINI_MODEL: RATES}}))
    upstreams = prices.parent / "upstreams.json"
    # With named upstreams, the chat, Responses, embeddings and Messages routes go only to them.
    upstreams.write_text(json.dumps({"upstreams": [
        {"name": "openai", "api": "openai", "base_url": f"{stub.url}/v1",
         "models": [MODEL, EMBEDDING_MODEL]},
        {"name": "anthropic", "api": "anthropic", "base_url": stub.url,
         "models": [CLAUDE_MODEL]},
        {"name": "google", "api": "gemini", "base_url": stub.url,
         "api_key_env": "FUZZ_GEMINI_KEY", "models": [GEMINI_MODEL]}]}))
    with ServiceProcess({
        "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_PRICES_FILE": str(prices), "CEILING_UPSTREAM_URL": f"{stub.url}/v1",
        "CEILING_ANTHROPIC_URL": stub.url, "CEILING_UPSTREAMS": str(upstreams),
        "FUZZ_GEMINI_KEY": "fuzz", "CEILING_UPSTREAM_TIMEOUT_S": "30",
        "CEILING_DEFAULT_MAX_OUTPUT_TOKENS": str(OUTPUT_TOKENS_DEFAULT),
    }) as service:
        yield service


def served_model(case: Any, keep_own: bool) -> Any:
    """A gateway case with the model both sides price and an Idempotency-Key of its own (the
    generated ones repeat, and a repeat is refused as a conflict), unless it keeps its own; a
    Messages case also with the version header the provider requires, and no generated beta
    (which the gateway refuses unless it knows it)."""
    if case.path in GEMINI_PATHS and isinstance(case.body, dict) and not keep_own:
        case.path_parameters = {**(case.path_parameters or {}), "model": GEMINI_MODEL}
        if case.path.endswith(":streamGenerateContent"):
            case.query = {**(case.query or {}), "alt": "sse"}
        config = case.body.get("generationConfig")
        if isinstance(config, dict):
            thinking = config.get("thinkingConfig")
            config["thinkingConfig"] = {**(thinking if isinstance(thinking, dict) else {}),
                                        "thinkingBudget": 0}
        else:
            case.body["generationConfig"] = {"thinkingConfig": {"thinkingBudget": 0}}
        if "Idempotency-Key" in (case.headers or {}):
            case.headers["Idempotency-Key"] = uuid.uuid4().hex
    elif case.path in GATEWAY_PATHS and isinstance(case.body, dict) and not keep_own:
        messages = case.path == "/v1/messages"
        case.body["model"] = (CLAUDE_MODEL if messages else EMBEDDING_MODEL
                              if case.path == "/v1/embeddings" else MODEL)
        if "Idempotency-Key" in (case.headers or {}):
            case.headers["Idempotency-Key"] = uuid.uuid4().hex
        if messages:
            case.headers = {**(case.headers or {}), "anthropic-version": API_VERSION}
            case.headers.pop("anthropic-beta", None)
    return case


class Witness:
    """The checks after each case, over one client: a new client a case would cost more CPU
    than the case (its SSL context)."""

    def __init__(self, http: httpx.Client, service: ServiceProcess, stub: StubProvider) -> None:
        self.http, self.service, self.stub = http, service, stub

    def requests_served(self) -> int:
        """Requests the provider has received, billed or not."""
        got = self.http.get(f"{self.stub.url}/billing", params={"log": 0})
        return int(got.json()["requests"])

    def relayed(self, status: int, requests_before: int) -> bool:
        """Whether the provider answered the case's request with `status` itself."""
        got = self.http.get(f"{self.stub.url}/billing").json()
        return int(got["requests"]) > requests_before and got["log"][-1]["status"] == status

    def legs(self, auth: str) -> list[dict[str, Any]]:
        me = self.http.get(f"{self.service.url}/v1/budgets/me", headers={"Authorization": auth})
        assert me.status_code == 200, me.text
        legs: list[dict[str, Any]] = me.json()["budgets"]
        return legs

    def check_books(self, auth: str) -> None:
        for leg in self.legs(auth):
            assert leg["reserved_micros"] >= 0
            assert leg["committed_micros"] + leg["reserved_micros"] <= (
                leg["ceiling_micros"] + leg["overshoot_micros"]), leg

    def held_micros(self, auth: str) -> int:
        """What a budget has committed and still holds."""
        [leg] = self.legs(auth)
        return int(leg["committed_micros"]) + int(leg["reserved_micros"])


@pytest.mark.slow
def test_no_route_answers_5xx_and_the_books_hold(gateway: ServiceProcess,
                                                 stub: StubProvider) -> None:
    with client_for(gateway) as http:
        sidecar_tag, gateway_tag = (f"org:fz{uuid.uuid4().hex[:8]}" for _ in range(2))
        http.budget(sidecar_tag, SIDECAR_CEILING_MICROS)
        http.budget(gateway_tag, GATEWAY_CEILING_MICROS)
        sidecar_auth = http.sidecar_key(sidecar_tag)["Authorization"]
        gateway_auth = http.key(gateway_tag)["Authorization"]
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {operation.path for operation in operations} >= GATEWAY_PATHS
    assert len(operations) >= 10
    billed_before = fetch_bill(stub.url, with_log=False).by_model.get(MODEL)
    assert billed_before is None  # the model is this test's: the whole bill below is its own
    with httpx.Client(timeout=30.0) as http:
        witness = Witness(http, gateway, stub)
        # schemathesis' pytest plugin does not run under this pytest; its strategies are driven
        # directly, one Hypothesis run per operation.
        for operation in operations:
            auth = (f"Bearer {ADMIN_TOKEN}" if operation.path.startswith("/v1/admin")
                    else gateway_auth if operation.path in GATEWAY_PATHS else sidecar_auth)
            fuzz(operation, auth, witness, (sidecar_auth, gateway_auth))
        bill = fetch_bill(stub.url)
        billed = [c for c in bill.log
                  if c.model in (MODEL, CLAUDE_MODEL, EMBEDDING_MODEL, GEMINI_MODEL) and c.billed]
        for api in ("chat.completions", "responses", "messages", "embeddings", "gemini"):
            assert sum(c.api == api for c in billed) >= BILLED_CALLS_MIN, (api, len(billed))
        assert witness.held_micros(gateway_auth) >= sum(c.cost_micros for c in billed) > 0


def fuzz(operation: Any, auth: str, witness: Witness, budgets: tuple[str, ...]) -> None:
    """One Hypothesis run of an operation's cases, each checked as it is answered."""
    cases = st.builds(served_model, operation.as_strategy(headers={"Authorization": auth}),
                      st.booleans())

    @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case: Any) -> None:
        requests_before = witness.requests_served()
        response = case.call(base_url=witness.service.url, timeout=60)
        status = response.status_code
        # A provider's error relayed is the provider's; any other 5xx is the service's.
        assert status < 500 or witness.relayed(status, requests_before), (
            case.method, case.path, status, response.text[:500])
        for budget_auth in budgets:
            witness.check_books(budget_auth)

    run()
