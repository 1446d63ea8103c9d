"""POST /v1/messages tried as a hostile key holder would, judged by the provider's bill (issue 15).

Each test is an attack on Anthropic's Messages API through real gateway instances in front of
the stub provider's Anthropic routes, with the real `anthropic` SDK, against a small ceiling,
repeated until the ceiling would have been passed several times over if the hole were open.
tests/api/hostile.py judges each by the stub's bill and the ledger's books in Redis, as the
OpenAI suite (test_hostile.py) is judged: the bill within the ceiling, committed at least the
bill, nothing left held, and where the test says so every call billed at most its hold and the
books equal to the bill to the micro-dollar.

Prices are independent on the two sides: the service prices Claude from genai-prices' bundled
table and the stub from its own (infra/stub_prices.json); the web search test model is written
into each side's table apart. The stub answers every call to its output cap, so a call's bill is
near its hold and a hole shows in the bill. The gateway runs with CEILING_EXPIRE_POLICY=release,
the policy a gateway call must not be resolved by.

Each attack prints one line (`-s`): calls sent, calls the provider billed, ceiling, billed and
committed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, fetch_bill, reset_bill
from tests.api.conftest import (
    Client,
    FaultProxy,
    account,
    anthropic_sdk,
    gateway,
    settled,
)
from tests.api.hostile import Attack, control, judge, streamed
from tests.infra.media import b64, pdf, png
from tests.support import write_prices

# The attack batteries run outside the dev loop (`-m "not slow"`) and in CI: each attack drives
# real gateway processes with a real SDK until the ceiling would have been passed several times
# over, the most CPU of any module in tests/api/. The dev loop keeps the gateway's own suites.
pytestmark = pytest.mark.slow

# The web search test model, in each side's own format. Anthropic documents no size for a
# search's results: the stub bills SEARCH_RESULT_TOKENS a search, and the operator states the
# same bound in the service's prices file.
SEARCH_MODEL = "hx-claude-search"
SEARCH_RESULT_TOKENS = 2_000
STUB_TABLE = {"models": {SEARCH_MODEL: {
    "input_usd_per_mtok": "1.00", "output_usd_per_mtok": "5.00", "web_search_usd_per_1k": "10.00",
    "anthropic": {"context_window_tokens": 200_000, "output_tokens_max": 64_000,
                  "cache_tokens_min": 1_024, "tool_prompt_tokens": {"auto": 346, "any": 313},
                  "keeps_thinking": False}}}}
SERVICE_PRICES = {"models": {SEARCH_MODEL: {
    "input_usd_per_mtok": "1.00", "output_usd_per_mtok": "5.00", "usd_per_web_search": "0.01",
    "web_search_result_tokens_max": SEARCH_RESULT_TOKENS}}}
SONNET, SONNET_4, HAIKU = "claude-sonnet-4-5", "claude-sonnet-4", "claude-haiku-4-5"
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
# Far above any output cap here: every answer runs to its cap.
OUTPUT_TOKENS_MEAN = 1_000_000
HOSTILE_ENV = {"CEILING_EXPIRE_POLICY": "release"}
INTERLEAVED = {"anthropic-beta": "interleaved-thinking-2025-05-14"}
CONTEXT_1M = {"anthropic-beta": "context-1m-2025-08-07"}


@pytest.fixture(scope="module")
def prices_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_prices(tmp_path_factory, "hostile-messages", SERVICE_PRICES)


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=15, latency_ms_min=0, latency_ms_max=2,
                      output_tokens_mean=OUTPUT_TOKENS_MEAN, prices=STUB_TABLE) as provider:
        yield provider


@pytest.fixture(scope="module")
def gw(redis_server: RedisServer, prices_file: str, proxy: FaultProxy,
       stub: StubProvider) -> Iterator[ServiceProcess]:
    env = {**HOSTILE_ENV, "CEILING_ANTHROPIC_URL": proxy.url}
    with gateway(redis_server, prices_file, f"{stub.url}/v1", 30, env) as service:
        yield service


@pytest.fixture(autouse=True)
def fresh_provider(stub: StubProvider, proxy: FaultProxy) -> Iterator[None]:
    """Each attack is judged by its own bill: a new one, no faults, nothing registered."""
    control(stub, images={}, files={}, prompt_cache=True,
            web_search_result_tokens=SEARCH_RESULT_TOKENS)
    reset_bill(stub.url)
    yield
    proxy.disarm()
    control(stub)


def refused_unbounded(create: Callable[..., Any], field: str, code: str = "input_unbounded",
                      **request: Any) -> None:
    """The call is refused before anything is held, naming `field`; the SDK retries nothing."""
    with pytest.raises(anthropic.UnprocessableEntityError) as refused:
        create(**request)
    error = refused.value.body["error"]  # type: ignore[index]
    assert (error["type"], error["code"], error["field"]) == (
        "invalid_request_error", code, field), error
    assert refused.value.response.headers["x-ceiling-reserved-micros"] == "0"


def nothing_reached_the_provider(stub: StubProvider) -> None:
    assert fetch_bill(stub.url).requests == 0


# -- thinking -----------------------------------------------------------------------------------


def test_a_thinking_budget_above_max_tokens_is_refused_and_one_inside_is_held(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """With the interleaved-thinking beta the provider takes a thinking budget above max_tokens;
    the gateway holds max_tokens for all of a call's output, so it refuses the budget that does
    not fit. Budgets inside it are held and billed, thinking included."""
    ceiling = 40_000  # 2,000 out at $5 a million is 10,000: ~4 calls
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    for budget in (2_001, 8_000, 64_000):
        refused_unbounded(messages.create, "thinking.budget_tokens", model=HAIKU,
                          max_tokens=2_000, messages=HELLO, extra_headers=INTERLEAVED,
                          thinking={"type": "enabled", "budget_tokens": budget})
    nothing_reached_the_provider(stub)
    attack = Attack("messages: thinking budgets above and inside max_tokens")
    for i in range(12):  # ~3x the ceiling
        if i % 2:
            attack.send(messages.with_raw_response.create, model=HAIKU, max_tokens=2_000,
                        messages=HELLO, extra_headers=INTERLEAVED,
                        thinking={"type": "enabled", "budget_tokens": 4_000 + i})
        else:
            attack.send(messages.with_raw_response.create, model=HAIKU, max_tokens=2_000,
                        messages=HELLO, thinking={"type": "enabled", "budget_tokens": 1_500})
    assert attack.refusals["input_unbounded"] == 6
    assert attack.refusals["budget_exceeded"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert verdict.bill.total.reasoning_tokens > 0


# -- input the gateway must bound: images, documents, tools, system prompts ----------------------

IMAGE_URL_HUGE = "https://images.hostile.test/huge.png"  # registered with the stub
IMAGE_FILE = "file_hostile_image"


def image(source: dict[str, Any]) -> dict[str, Any]:
    return {"type": "image", "source": source}


def look(*blocks: dict[str, Any]) -> list[Any]:
    return [{"role": "user", "content": [*blocks, {"type": "text", "text": "what is this?"}]}]


def test_images_are_held_at_the_most_claude_bills_for_them(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """An image billed ~1,640 tokens sent as a 33-byte PNG header that claims 6,000 x 4,000 px,
    by URL, by file id, several to a message and inside a tool's result: each call is billed at
    most its hold."""
    ceiling = 60_000
    tag, key = account(admin, ceiling)
    control(stub, images={IMAGE_URL_HUGE: [8_000, 8_000]},
            files={IMAGE_FILE: {"bytes": 100, "image": [4_000, 4_000]}})
    tiny_huge = {"type": "base64", "media_type": "image/png", "data": b64(png(6_000, 4_000))}
    by_url = {"type": "url", "url": IMAGE_URL_HUGE}
    by_file = {"type": "file", "file_id": IMAGE_FILE}
    tool_turns: list[Any] = [
        {"role": "user", "content": "look at the screen"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screen",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [image(tiny_huge), image(by_url)]}]},
    ]
    screen = [{"name": "screen", "input_schema": {"type": "object"}}]
    messages = anthropic_sdk(gw, key).messages
    variants: list[Callable[[], Any]] = [
        lambda: messages.with_raw_response.create(model=SONNET, max_tokens=16,
                                                  messages=look(image(tiny_huge))),
        lambda: messages.with_raw_response.create(model=SONNET, max_tokens=16,
                                                  messages=look(image(by_url))),
        lambda: messages.with_raw_response.create(
            model=SONNET, max_tokens=16, messages=look(image(by_file)),
            extra_headers={"anthropic-beta": "files-api-2025-04-14"}),
        lambda: messages.with_raw_response.create(
            model=SONNET, max_tokens=16,
            messages=look(image(tiny_huge), image(by_url), image(tiny_huge))),
        lambda: messages.with_raw_response.create(model=SONNET, max_tokens=16,
                                                  messages=tool_turns, tools=screen),
    ]
    attack = Attack("messages: images (a tiny file of a huge image, URLs, tool results)")
    for i in range(20):  # ~4x the ceiling's worth if each image were held as its bytes
        attack.send(variants[i % len(variants)])
    assert attack.refusals["budget_exceeded"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert verdict.bill.total.image_input_tokens >= 1_600 * verdict.provider_calls


def test_pdfs_and_files_the_request_only_refers_to_are_held_at_the_context_window(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """A PDF is billed for its text (which its compressed bytes do not bound) and an image of
    every page; a file by URL or id, for what the provider finds there; citations add a system
    prompt and chunks. Each is held at the model's context window, whatever the body holds: a
    100-page PDF, and files registered with the stub at 10 and 50 MB (the provider refuses what
    is past its window, and bills nothing). Judged by the bill."""
    ceiling = 5_000_000
    tag, key = account(admin, ceiling)
    control(stub, files={"file_pdf": {"bytes": 50_000_000, "pages": 100},
                         "file_fits": {"bytes": 600_000, "pages": 60},
                         "https://docs.hostile.test/a.pdf": {"bytes": 10_000_000, "pages": 100}})
    create = anthropic_sdk(gw, key).messages.with_raw_response.create
    documents = [
        {"type": "base64", "media_type": "application/pdf", "data": b64(pdf(100))},
        {"type": "url", "url": "https://docs.hostile.test/a.pdf"},
        {"type": "file", "file_id": "file_pdf"},
        {"type": "file", "file_id": "file_fits"},
    ]
    attack = Attack("messages: PDFs, files by URL and id, citations")
    for i in range(12):
        source = documents[i % len(documents)]
        attack.send(create, model=SONNET, max_tokens=16,
                    messages=look({"type": "document", "source": source}))
    attack.send(create, model=SONNET, max_tokens=16,
                messages=look({"type": "document", "citations": {"enabled": True},
                               "source": {"type": "text", "media_type": "text/plain",
                                          "data": "cite me"}}))
    # Past the window the provider refuses (released); what fits is billed, each under its hold.
    assert attack.outcomes()["released"] > 0
    assert attack.outcomes()["billed"] > 0
    judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)


def test_tool_definitions_and_their_system_prompt_are_inside_the_hold(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """Every call with tools is billed a tool-use system prompt (346 tokens on Claude 4.5) on
    top of the definitions: with one tiny tool and one output token it is most of the bill, so a
    hold that left it out would be below it. Then a long tool list, and a long system prompt."""
    ceiling = 60_000
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    tiny = [{"name": "f", "input_schema": {"type": "object"}}]
    many = [{"name": f"tool_{i}", "description": "does a thing " * 20,
             "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}
            for i in range(40)]
    variants: list[Callable[[], Any]] = [
        lambda: messages.with_raw_response.create(model=HAIKU, max_tokens=1, messages=HELLO,
                                                  tools=tiny),
        lambda: messages.with_raw_response.create(model=HAIKU, max_tokens=1, messages=HELLO,
                                                  tools=tiny, tool_choice={"type": "any"}),
        lambda: messages.with_raw_response.create(model=HAIKU, max_tokens=1, messages=HELLO,
                                                  tools=many),
        lambda: messages.with_raw_response.create(model=HAIKU, max_tokens=1, messages=HELLO,
                                                  system="You are terse. " * 1_000),
    ]
    attack = Attack("messages: tool definitions, the tool-use system prompt, system prompts")
    for i in range(40):  # the tool list and the system prompt, ~4x the ceiling's worth
        attack.send(variants[i % len(variants)])
    assert attack.refusals["budget_exceeded"] > 0
    judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    # A system prompt far above the ceiling is refused by the ledger, not forwarded.
    _, small_key = account(admin, 10_000)
    reset_bill(stub.url)
    with pytest.raises(anthropic.APIStatusError) as refused:
        anthropic_sdk(gw, small_key, max_retries=2).messages.create(
            model=HAIKU, max_tokens=1, messages=HELLO, system="x" * 3_000_000)
    assert (refused.value.status_code, refused.value.body["error"]["code"]) == (  # type: ignore[index]
        402, "budget_exceeded")
    nothing_reached_the_provider(stub)


# -- server tools -----------------------------------------------------------------------------


def test_web_search_is_held_at_max_uses_or_the_gateways(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """Web search bills $10 per 1,000 searches and its results as input. A key holder asks the
    model for 5 searches a call: with max_uses 2 the provider runs two, and the call is held at
    two searches' fees and results; without max_uses the gateway sends its own (and says so),
    and the call is held at that many. A model whose results have no stated bound is held at its
    context window each step (here: past the ceiling, so refused before the provider); web
    fetch, whose pages have no bound at all, is refused."""
    ceiling = 150_000  # a call bills ~24,000: 2 searches (20,000) and their 4,000 tokens
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    search = {"type": "web_search_20250305", "name": "web_search"}
    refused_unbounded(messages.create, "tools[0]", model=SEARCH_MODEL, max_tokens=64,
                      messages=HELLO, tools=[{"type": "web_fetch_20250910", "name": "web_fetch",
                                              "max_uses": 1}])
    with pytest.raises(anthropic.APIStatusError) as held_at_window:
        messages.create(model=SONNET, max_tokens=64, messages=HELLO,
                        tools=[{**search, "max_uses": 1}])
    assert held_at_window.value.status_code == 402
    nothing_reached_the_provider(stub)
    control(stub, web_searches=5)  # the model searches 5 times a call if it may
    attack = Attack("messages: web searches past max_uses, or with none given")
    for i in range(24):  # ~4x the ceiling
        tool = {**search, "max_uses": 2} if i % 2 else search
        raw = attack.send(messages.with_raw_response.create, model=SEARCH_MODEL, max_tokens=64,
                          messages=HELLO, tools=[tool], stream=i % 3 == 2)
        if raw is not None and tool is search:
            # The gateway's default (core/formats/messages.py WEB_SEARCH_MAX_USES_DEFAULT).
            assert raw.headers["x-ceiling-bounds-added"] == "tools[0].max_uses=5"
    assert attack.refusals["budget_exceeded"] + attack.refusals["budget_busy"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert verdict.bill.total.web_search_requests > 2 * verdict.provider_calls > 0


# -- cache writes, betas ---------------------------------------------------------------------------


def test_1_hour_cache_writes_are_settled_at_their_rate(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """Each call writes a new 1-hour prefix (2x the input rate), or reads one (0.1x): every
    input token is held at the dearest input-side rate, and each is settled at what it was."""
    ceiling = 60_000
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    attack = Attack("messages: 1-hour cache writes and reads")
    for i in range(24):
        manual = f"Manual {i // 2}. " + "Rule. " * 1_000  # 1,500 tokens: above the minimum
        system = [{"type": "text", "text": manual,
                   "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
        attack.send(messages.with_raw_response.create, model=SONNET, max_tokens=100,
                    system=system, messages=HELLO, stream=i % 4 == 3)
    assert attack.refusals["budget_exceeded"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    total = verdict.bill.total
    assert total.cache_write_1h_tokens > 0
    assert total.cached_input_tokens > 0


def test_betas_that_change_what_a_call_bills_are_held_or_refused(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """The 1M-context beta bills a call above 200K input tokens at long-context rates (2x in,
    1.5x out). For claude-sonnet-4-5, whose long-context rates genai-prices has, such a call is
    held at them; for claude-sonnet-4, whose it lacks, the beta is refused. Fast mode (6x) and
    betas the gateway does not know are refused."""
    # A 900 KB prompt is 225K tokens: ~$1.35 billed, held at ~$6.75 (900K tokens by its bytes,
    # at the long-context 5-minute write's $7.50): two fit, the third is refused.
    ceiling = 9_000_000
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    long_prompt = [{"role": "user", "content": "Read this. " + "word " * 180_000}]
    for beta in ("context-1m-2025-08-07", "fast-mode-2026-02-01", "betas-of-tomorrow"):
        refused_unbounded(messages.create, "anthropic-beta", model=SONNET_4, max_tokens=100,
                          messages=long_prompt, extra_headers={"anthropic-beta": beta})
    refused_unbounded(messages.create, "speed", "field_unsupported", model=SONNET,
                      max_tokens=100, messages=HELLO, extra_body={"speed": "fast"})
    nothing_reached_the_provider(stub)
    attack = Attack("messages: the 1M-context beta above 200K tokens")
    for _ in range(5):
        attack.send(messages.with_raw_response.create, model=SONNET, max_tokens=100,
                    messages=long_prompt, extra_headers=CONTEXT_1M)
    assert attack.refusals["budget_exceeded"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)
    assert {c.service_tier for c in verdict.bill.log if c.billed} == {"long_context"}


# -- streams ---------------------------------------------------------------------------------------


def test_a_stream_its_client_hangs_up_on_is_charged_what_the_provider_billed(
    gw: ServiceProcess, admin: Client, proxy: FaultProxy, stub: StubProvider,
    redis_server: RedisServer,
) -> None:
    """The client reads two events and hangs up, stream after stream. The provider bills the
    whole answer; the gateway reads on to message_stop and settles from its usage."""
    ceiling = 10_000  # 200 out at $15 a million: 3,000 billed, ~4,200 held: ~3 streams
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    proxy.throttle = True  # relayed over most of a second: the client leaves mid-stream
    attack = Attack("messages: streams hung up on")
    for _ in range(6):  # ~3x the ceiling if a hang-up were settled at what was read
        raw = attack.send(messages.with_raw_response.create, model=SONNET, max_tokens=200,
                          messages=HELLO, stream=True)
        if raw is None:
            continue
        stream = raw.parse()
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
        settled(admin, tag)  # read to its end after its client left, then settled
    assert attack.refusals["budget_exceeded"] > 0
    judge(attack, stub, redis_server, tag, ceiling, exact=True, per_call=True)


def test_a_stream_the_provider_breaks_off_stays_held(
    gw: ServiceProcess, admin: Client, stub: StubProvider, redis_server: RedisServer,
) -> None:
    """Billed, then cut off after message_start, after the last delta (its usage the whole
    answer's), or failed with an error event: none reached message_stop, so each keeps its hold,
    and expiry charges it."""
    ceiling = 20_000
    tag, key = account(admin, ceiling)
    messages = anthropic_sdk(gw, key).messages
    faults: list[dict[str, Any]] = [{"break_after_events": 2}, {"break_after_events": 99},
                                    {"fail_after_billing": 529}, {}]
    attack = Attack("messages: streams broken off")
    complete = 0
    for i in range(12):
        control(stub, **faults[i % len(faults)], calls=1)
        raw = attack.send(messages.with_raw_response.create, model=SONNET, max_tokens=200,
                          messages=HELLO, stream=True)
        if raw is not None:
            complete += streamed(raw)
    assert attack.refusals["budget_busy"] + attack.refusals["budget_exceeded"] > 0
    verdict = judge(attack, stub, redis_server, tag, ceiling, per_call=True)
    assert 0 < complete < verdict.provider_calls
