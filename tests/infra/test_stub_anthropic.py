"""The stub's Messages API is the witness a gateway's /v1/messages is judged by: it must bill what
Anthropic would.

Every figure is worked by hand from Anthropic's documentation (cited beside it), never computed
by the code under test, and this module imports nothing from `core`. What every route shares
(faults, /control, the bill, the key, the price table's checks, a fuzz of any body) is tested
in tests/infra/test_stub_provider.py. Calls go through the real `anthropic` SDK, sync and
async, wherever a client would use it; raw httpx where a test reads the wire itself or sends
what the SDK would not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from infra.stub_provider import StubProvider
from tests.infra.conftest import start_fresh
from tests.infra.media import b64, jpeg, pdf, png
from tests.infra.test_stub_provider import bill_of, forced, only_call, sse_data

# The SDK warns that claude-opus-4-5 is deprecated; the table still prices it, as Anthropic does.
pytestmark = pytest.mark.filterwarnings("ignore:The model .* is deprecated:DeprecationWarning")

KEY = "sk-ant-stub"
MESSAGES = "/v1/messages"
VERSION = {"anthropic-version": "2023-06-01"}
HELLO: Any = [{"role": "user", "content": "hello"}]
# "hello": 5 UTF-8 bytes -> ceil(5 / 4) = 2 tokens, + 4 for the message, + 3 for the reply.
HELLO_TOKENS = 9
SONNET = "claude-sonnet-4-5"
# A 5,000-byte text: 1,250 tokens, above Sonnet 4.5's 1,024-token cache minimum.
LONG = "x" * 5_000
LONG_TOKENS = 1_250
# {"name":"f","input_schema":{"type":"object"}}: 45 bytes -> 12 tokens.
TOOL_F: Any = [{"name": "f", "input_schema": {"type": "object"}}]
TOOL_F_TOKENS = 12
# {"type":"web_search_20250305","name":"web_search","max_uses":2}: 63 bytes -> 16 tokens.
WEB_SEARCH: Any = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]
WEB_SEARCH_TOKENS = 16


@pytest.fixture(scope="module")
def provider() -> Iterator[StubProvider]:
    with StubProvider(seed=5, latency_ms_min=0, latency_ms_max=2, api_key=KEY) as stub:
        yield stub


@pytest.fixture(scope="module")
def http(provider: StubProvider) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=provider.url, timeout=10.0,
                      headers={"x-api-key": KEY, **VERSION}) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(provider: StubProvider) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=provider.url, api_key=KEY, max_retries=0, timeout=10.0)


@pytest.fixture
def asdk(provider: StubProvider) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=provider.url, api_key=KEY, max_retries=0,
                                    timeout=10.0)


@pytest.fixture(autouse=True)
def fresh_bill(http: httpx.Client) -> None:
    start_fresh(http, {"images": {}, "files": {}, "prompt_cache": True, "clock_offset_s": 0,
                       "web_search_result_tokens": 8_000})


def costs(http: httpx.Client) -> list[int]:
    return [c.cost_micros for c in bill_of(http).log]


def at_clock(http: httpx.Client, seconds: float) -> None:
    http.post("/control", json={"clock_offset_s": seconds}).raise_for_status()


def create(sdk: anthropic.Anthropic, tokens: int | None = 10,
           **kwargs: Any) -> anthropic.types.Message:
    """A call through the SDK answering exactly `tokens` output tokens (None: drawn)."""
    kwargs.setdefault("model", SONNET)
    kwargs.setdefault("max_tokens", 100)
    kwargs.setdefault("messages", HELLO)
    headers = ({} if tokens is None else forced(tokens)) | kwargs.pop("extra_headers", {})
    message: anthropic.types.Message = sdk.messages.create(**kwargs, extra_headers=headers)
    return message


def sse_events(http: httpx.Client, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The JSON of each SSE event read, and whether the stream ended cleanly."""
    return sse_data(http, MESSAGES, {"stream": True, **body}, headers)


# -- pricing (https://platform.claude.com/docs/en/about-claude/pricing) ------------------------


@pytest.mark.parametrize(("model", "cost"), [
    # Base input and output per million tokens; 9 in, 100 out.
    (SONNET, 1_527),  # $3 / $15: 27 + 1,500
    ("claude-sonnet-4-5-20250929", 1_527),  # the dated name is the same model
    ("claude-opus-4-1", 7_635),  # $15 / $75: 135 + 7,500
    ("claude-opus-4-5", 2_545),  # $5 / $25: 45 + 2,500
    ("claude-haiku-4-5", 509),  # $1 / $5: 9 + 500
    ("claude-3-5-haiku-20241022", 408),  # $0.80 / $4: 7.2 + 400 = 407.2, rounded up
    ("claude-opus-5-5", 2_036),  # $4 / $20: 36 + 2,000 (Claude Code 2.1's default)
    ("claude-sonnet-5-5", 1_018),  # $2 / $10: 18 + 1,000
])
def test_each_model_is_billed_at_anthropics_published_rates(
    sdk: anthropic.Anthropic, http: httpx.Client, model: str, cost: int
) -> None:
    message = create(sdk, 100, model=model, max_tokens=200)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (HELLO_TOKENS, 100)
    call = only_call(http)
    assert (call.api, call.model, call.cost_micros, call.service_tier) == (
        "messages", model, cost, "standard")


def test_a_message_answers_in_anthropics_shape(sdk: anthropic.Anthropic) -> None:
    raw = sdk.messages.with_raw_response.create(
        model=SONNET, max_tokens=100, messages=HELLO, extra_headers=forced(30))
    message = raw.parse()
    assert raw.headers["request-id"].startswith("req_")
    assert message.id.startswith("msg_")
    assert (message.type, message.role, message.model, message.stop_reason) == (
        "message", "assistant", SONNET, "end_turn")
    [block] = message.content
    assert block.type == "text"
    assert len(block.text.split(" ")) == 30
    usage = message.usage
    assert (usage.cache_creation_input_tokens, usage.cache_read_input_tokens,
            usage.service_tier) == (0, 0, "standard")
    assert usage.cache_creation is not None
    assert usage.server_tool_use is None  # no server tool was given


def test_output_stops_at_max_tokens(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    for _ in range(20):
        message = create(sdk, None, max_tokens=40)
        tokens = message.usage.output_tokens
        assert 1 <= tokens <= 40
        assert message.stop_reason == ("max_tokens" if tokens == 40 else "end_turn")
    capped = create(sdk, 500, max_tokens=40)
    assert (capped.usage.output_tokens, capped.stop_reason) == (40, "max_tokens")


def test_a_stop_sequence_ends_the_text_where_it_appears(sdk: anthropic.Anthropic) -> None:
    # The answer's words are "the ceiling holds ...": "holds" is the third, so three tokens
    # were generated and the text ends before it.
    message = create(sdk, 10, stop_sequences=["holds"])
    assert (message.stop_reason, message.stop_sequence, message.usage.output_tokens) == (
        "stop_sequence", "holds", 3)
    assert message.content[0].text == "the ceiling "  # type: ignore[union-attr]


# -- tools (https://platform.claude.com/docs/en/agents-and-tools/tool-use/overview, pricing) -----


@pytest.mark.parametrize(("model", "choice", "overhead"), [
    # The tool-use system prompt: 346 tokens for auto or none, 313 for any or tool, on Claude 4
    # models; 264 and 340 on Claude Haiku 3.5.
    (SONNET, None, 346), (SONNET, {"type": "auto"}, 346), (SONNET, {"type": "none"}, 346),
    (SONNET, {"type": "any"}, 313), (SONNET, {"type": "tool", "name": "f"}, 313),
    ("claude-opus-4-1", {"type": "any"}, 313),
    ("claude-3-5-haiku-20241022", {"type": "auto"}, 264),
    ("claude-3-5-haiku-20241022", {"type": "any"}, 340),
])
def test_tools_bill_their_definitions_and_the_tool_use_system_prompt(
    sdk: anthropic.Anthropic, model: str, choice: Any, overhead: int
) -> None:
    extra = {} if choice is None else {"tool_choice": choice}
    message = create(sdk, 10, model=model, tools=TOOL_F, **extra)
    assert message.usage.input_tokens == HELLO_TOKENS + overhead + TOOL_F_TOKENS


def test_a_forced_tool_is_answered_with_a_tool_use_block(sdk: anthropic.Anthropic) -> None:
    message = create(sdk, 5, tools=TOOL_F, tool_choice={"type": "any"})
    [call] = message.content
    assert call.type == "tool_use"
    assert (call.name, call.input, message.stop_reason) == (
        "f", {"text": "the ceiling holds when every"}, "tool_use")
    assert call.id.startswith("toolu_")


# -- images (https://platform.claude.com/docs/en/build-with-claude/vision) ---------------------


def image_block(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": b64(data)}}


def image_messages(block: dict[str, Any]) -> Any:
    # "what is this?": 13 bytes -> 4 tokens; the image block's JSON is not text.
    return [{"role": "user", "content": [block, {"type": "text", "text": "what is this?"}]}]


# The prompt around image_messages' image: 4 text + 4 message + 3 reply.
IMAGE_FRAME_TOKENS = 11


@pytest.mark.parametrize(("size", "tokens"), [
    # tokens = width x height / 750 ("calculate image costs"), rounded up: the docs' own table
    # gives ~54 for 200 x 200, ~1,334 for 1000 x 1000 and ~1,590 for 1092 x 1092.
    ((200, 200), 54),  # 40,000 / 750 = 53.3
    ((1000, 1000), 1_334),  # 1,000,000 / 750 = 1,333.3
    ((1092, 1092), 1_590),  # 1,192,464 / 750 = 1,589.95
    # 784 x 1568, the largest 1:2 size the docs list as not resized: 1,229,312 / 750 = 1,639.1.
    ((784, 1568), 1_640),
    # 2000 x 1000: the long edge is above 1,568, so it is scaled to 1568 x 784 = 1,640 tokens.
    ((2000, 1000), 1_640),
    # 4000 x 4000: to 1568 x 1568 (2,458,624 px), then to the 1,229,312 px cap:
    # isqrt(1,229,312) = 1,108 a side, 1,227,664 / 750 = 1,636.9.
    ((4000, 4000), 1_637),
])
def test_an_image_is_billed_by_its_area_after_the_documented_resize(
    sdk: anthropic.Anthropic, http: httpx.Client, size: tuple[int, int], tokens: int
) -> None:
    message = create(sdk, 10, messages=image_messages(image_block(png(*size))))
    assert message.usage.input_tokens == IMAGE_FRAME_TOKENS + tokens
    assert bill_of(http).total.image_input_tokens == tokens
    # At Sonnet 4.5's $3 input: (11 + tokens) x 3 + 10 x 15.
    assert only_call(http).cost_micros == (IMAGE_FRAME_TOKENS + tokens) * 3 + 150


def test_an_image_by_url_or_file_is_sized_from_the_registry(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    url = "https://images.example/cat.jpg"
    by_url = {"type": "image", "source": {"type": "url", "url": url}}
    with pytest.raises(anthropic.BadRequestError, match="Unable to download"):
        create(sdk, 10, messages=image_messages(by_url))
    http.post("/control", json={"images": {url: [1000, 1000]},
                                "files": {"file_img": {"bytes": 10, "image": [200, 200]}}}
              ).raise_for_status()
    assert create(sdk, 10, messages=image_messages(by_url)).usage.input_tokens == 11 + 1_334
    by_file = {"type": "image", "source": {"type": "file", "file_id": "file_img"}}
    assert create(sdk, 10, messages=image_messages(by_file)).usage.input_tokens == 11 + 54
    assert bill_of(http).total.calls == 2


def test_more_than_twenty_images_must_each_fit_2000_pixels(http: httpx.Client) -> None:
    small, large = image_block(png(100, 100)), image_block(png(2_001, 100))
    for blocks, status in (([large] * 20, 200), ([large] + [small] * 20, 400),
                           ([small] * 21, 200)):
        response = http.post(MESSAGES, json={"model": SONNET, "max_tokens": 10, "messages": [
            {"role": "user", "content": blocks}]})
        assert response.status_code == status


# -- documents (https://platform.claude.com/docs/en/build-with-claude/pdf-support) -------------

# A PDF page is billed as a 1224 x 1584 image (US letter at 144 dpi): its long edge to 1,568
# (1211 x 1568 = 1,898,848 px), then to the 1,229,312 px cap: isqrt(1211 x 1,229,312 // 1568)
# = 974 by isqrt(1568 x 1,229,312 // 1211) = 1,261; 1,228,214 / 750 = 1,637.6.
PAGE_TOKENS = 1_638


def test_a_document_is_billed_for_its_text_and_an_image_of_each_page(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    http.post("/control", json={"files": {"https://files.example/r.pdf": {"bytes": 40,
                                                                          "pages": 3},
                                          "file_doc": {"bytes": 4_000}}}).raise_for_status()
    document = pdf(2)
    blocks: Any = [
        # A PDF: its bytes over four, and a page image each.
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": b64(document)}},
        # 400 bytes of text -> 100; its title "notes" (5 bytes) -> 2.
        {"type": "document", "title": "notes",
         "source": {"type": "text", "media_type": "text/plain", "data": "y" * 400}},
        # 40 bytes -> 10, + 3 pages.
        {"type": "document", "source": {"type": "url", "url": "https://files.example/r.pdf"}},
        {"type": "document", "source": {"type": "file", "file_id": "file_doc"}},  # 1,000
    ]
    message = create(sdk, 10, messages=[{"role": "user", "content": blocks}])
    file_tokens = -(-len(document) // 4) + 2 * PAGE_TOKENS + 10 + 3 * PAGE_TOKENS + 1_000
    assert message.usage.input_tokens == file_tokens + 102 + 4 + 3
    assert bill_of(http).total.file_input_tokens == file_tokens


# -- the prompt cache (https://platform.claude.com/docs/en/build-with-claude/prompt-caching) ----


def cached_system(*texts_and_ttls: tuple[str, str | None]) -> Any:
    blocks = []
    for text, ttl in texts_and_ttls:
        control = None if ttl is None else {"type": "ephemeral"} | (
            {"ttl": ttl} if ttl != "5m" else {})
        blocks.append({"type": "text", "text": text} | (
            {"cache_control": control} if control else {}))
    return blocks


# Sonnet 4.5's input is $3; a 5-minute write 1.25x ($3.75), a 1-hour write 2x ($6), a read 0.1x
# ($0.30); 9 uncached input tokens (27) and 10 out (150) a call. A 5-minute write of LONG:
# 1,250 x 3.75 + 177 = 4,864.5 -> 4,865; a 1-hour write: 1,250 x 6 + 177 = 7,677; a read:
# 1,250 x 0.30 + 177 = 552.
@pytest.mark.parametrize(("system", "steps"), [
    # (clock s, (read, 5-minute write, 1-hour write), cost) a call. Written at 0; read at 240
    # (expiry moves to 540) and at 480 (to 780); gone at 781.
    ([(LONG, "5m")], [(0, (0, 1_250, 0), 4_865), (240, (1_250, 0, 0), 552),
                      (480, (1_250, 0, 0), 552), (781, (0, 1_250, 0), 4_865),
                      (790, (1_250, 0, 0), 552)]),
    # A 1-hour entry outlives 5 minutes.
    ([(LONG, "1h")], [(0, (0, 0, 1_250), 7_677), (3_000, (1_250, 0, 0), 552),
                      (6_601, (0, 0, 1_250), 7_677)]),
    # Mixed TTLs, the docs' rule: A, the highest hit; B, the last 1-hour breakpoint after A; C,
    # the last breakpoint. Read A, write 1h B - A, write 5m C - B. Breakpoints at 1,250 and
    # 2,500: 1,250 x 6 + 1,250 x 3.75 + 177 = 12,364.5; at 301 s the 5-minute entry is gone,
    # the 1-hour one is not: 1,250 x 0.30 + 1,250 x 3.75 + 177 = 5,239.5.
    ([(LONG, "1h"), ("y" * 5_000, "5m")], [(0, (0, 1_250, 1_250), 12_365),
                                           (301, (1_250, 1_250, 0), 5_240)]),
], ids=["5m", "1h", "mixed"])
def test_the_cache_reads_and_writes_each_ttl_at_its_documented_rate(
    sdk: anthropic.Anthropic, http: httpx.Client, system: list[tuple[str, str]],
    steps: list[tuple[int, tuple[int, int, int], int]],
) -> None:
    for clock_s, (read, written_5m, written_1h), _ in steps:
        at_clock(http, clock_s)
        usage = create(sdk, 10, system=cached_system(*system)).usage
        assert usage.cache_creation is not None
        assert (usage.cache_read_input_tokens, usage.cache_creation.ephemeral_5m_input_tokens,
                usage.cache_creation.ephemeral_1h_input_tokens, usage.cache_creation_input_tokens,
                usage.input_tokens) == (read, written_5m, written_1h, written_5m + written_1h,
                                        HELLO_TOKENS)
    assert costs(http) == [cost for *_, cost in steps]
    total = bill_of(http).total
    assert (total.cached_input_tokens, total.cache_write_tokens, total.cache_write_1h_tokens) == (
        sum(s[1][0] for s in steps), sum(s[1][1] + s[1][2] for s in steps),
        sum(s[1][2] for s in steps))


@pytest.mark.parametrize(("model", "text", "cost"), [
    # Below the minimum cacheable prefix nothing is written and all is input.
    # Haiku 4.5: 4,096 tokens. 1,259 x 1 + 10 x 5 = 1,309.
    ("claude-haiku-4-5", LONG, 1_309),
    # Opus 4.5: 4,096 tokens. 1,259 x 5 + 10 x 25 = 6,545.
    ("claude-opus-4-5", LONG, 6_545),
    # Sonnet 4.5: 1,024 tokens; 4,000 bytes is 1,000. 1,009 x 3 + 150 = 3,177.
    (SONNET, "x" * 4_000, 3_177),
])
def test_a_prefix_below_the_models_minimum_is_not_cached(
    sdk: anthropic.Anthropic, http: httpx.Client, model: str, text: str, cost: int
) -> None:
    for _ in range(2):
        usage = create(sdk, 10, model=model, system=cached_system((text, "5m"))).usage
        assert (usage.cache_creation_input_tokens, usage.cache_read_input_tokens) == (0, 0)
    assert costs(http) == [cost, cost]


def test_a_growing_conversation_reads_the_prefix_it_cached(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    def turn(text: str) -> Any:
        return {"role": "user", "content": [{"type": "text", "text": text,
                                             "cache_control": {"type": "ephemeral"}}]}

    first = create(sdk, 10, messages=[turn(LONG)]).usage
    # The message: 4 + 1,250 cached; the reply's 3 are not.
    assert (first.cache_creation_input_tokens, first.input_tokens) == (1_254, 3)
    history = [{"role": "user", "content": [{"type": "text", "text": LONG}]},
               {"role": "assistant", "content": "ok"}, turn("more")]
    second = create(sdk, 10, messages=history).usage
    # The breakpoint moved to the new turn; 20 blocks back from it the old prefix is found:
    # read 1,254, write "ok" (4 + 1) and "more" (4 + 1).
    assert (second.cache_read_input_tokens, second.cache_creation_input_tokens,
            second.input_tokens) == (1_254, 10, 3)


def test_changing_thinking_drops_the_cached_messages_but_not_the_system(
    sdk: anthropic.Anthropic,
) -> None:
    messages: Any = [{"role": "user", "content": [
        {"type": "text", "text": "y" * 5_000, "cache_control": {"type": "ephemeral"}}]}]
    system = cached_system((LONG, "5m"))
    first = create(sdk, 10, system=system, messages=messages, max_tokens=2_000).usage
    assert first.cache_creation_input_tokens == 1_250 + 1_254
    thinking = create(sdk, 10, system=system, messages=messages, max_tokens=2_000,
                      thinking={"type": "enabled", "budget_tokens": 1_024}).usage
    assert (thinking.cache_read_input_tokens, thinking.cache_creation_input_tokens) == (
        1_250, 1_254)


def test_a_top_level_cache_control_caches_up_to_the_last_block(
    sdk: anthropic.Anthropic,
) -> None:
    messages = [{"role": "user", "content": LONG}]
    first = create(sdk, 10, messages=messages, cache_control={"type": "ephemeral"}).usage
    assert first.cache_creation_input_tokens == 1_254
    again = create(sdk, 10, messages=messages, cache_control={"type": "ephemeral"}).usage
    assert again.cache_read_input_tokens == 1_254


def test_max_tokens_0_fills_the_cache_and_answers_nothing(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    system = cached_system((LONG, "5m"))
    warm = sdk.messages.create(model=SONNET, max_tokens=0, system=system, messages=HELLO)
    assert (warm.content, warm.stop_reason, warm.usage.output_tokens,
            warm.usage.cache_creation_input_tokens) == ([], "max_tokens", 0, LONG_TOKENS)
    assert create(sdk, 10, system=system).usage.cache_read_input_tokens == LONG_TOKENS
    assert costs(http) == [4_715, 552]  # 4,687.5 + 27, rounded up; then the read


def test_the_cache_is_per_model_and_can_be_turned_off_or_forced(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    system = cached_system((LONG, "5m"))
    create(sdk, 10, system=system)
    assert create(sdk, 10, model="claude-opus-4-1", system=system
                  ).usage.cache_creation_input_tokens == LONG_TOKENS
    http.post("/control", json={"prompt_cache": False}).raise_for_status()
    usage = create(sdk, 10, system=system).usage
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (0, 0)
    forced_read = create(sdk, 10, extra_headers={"X-Stub-Cached-Tokens": "5"}).usage
    assert (forced_read.cache_read_input_tokens, forced_read.input_tokens) == (5, 4)


# -- extended thinking (https://platform.claude.com/docs/en/build-with-claude/extended-thinking)


def test_thinking_is_output_within_max_tokens_and_shown_summarized(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    message = create(sdk, 1_000, max_tokens=4_000,
                     thinking={"type": "enabled", "budget_tokens": 2_048})
    thinking, text = message.content
    assert (thinking.type, text.type) == ("thinking", "text")
    assert message.usage.output_tokens_details is not None
    # Half of the 1,000 tokens is thinking (within the 2,048 budget), billed in full as output;
    # the thinking shown is a summary of a word for every four tokens: 125 words.
    assert (message.usage.output_tokens,
            message.usage.output_tokens_details.thinking_tokens) == (1_000, 500)
    assert len(thinking.thinking.split(" ")) == 125  # type: ignore[union-attr]
    assert len(text.text.split(" ")) == 500  # type: ignore[union-attr]
    assert thinking.signature  # type: ignore[union-attr]
    # 9 x 3 + 1,000 x 15 = 15,027: thinking at the output rate.
    assert only_call(http).cost_micros == 15_027
    assert bill_of(http).total.reasoning_tokens == 500


def test_thinking_is_held_to_its_budget_and_all_of_it_to_max_tokens(
    sdk: anthropic.Anthropic,
) -> None:
    capped = create(sdk, 9_999, max_tokens=4_000,
                    thinking={"type": "enabled", "budget_tokens": 1_024})
    assert capped.usage.output_tokens_details is not None
    assert (capped.usage.output_tokens, capped.usage.output_tokens_details.thinking_tokens,
            capped.stop_reason) == (4_000, 1_024, "max_tokens")
    only_thinking = create(sdk, 3_000, max_tokens=3_000,
                           thinking={"type": "enabled", "budget_tokens": 2_000},
                           extra_headers={"X-Stub-Reasoning-Tokens": "3000"})
    assert [b.type for b in only_thinking.content] == ["thinking"]
    assert only_thinking.usage.output_tokens == 3_000
    # Interleaved thinking lets the budget exceed max_tokens, which still caps all of it.
    interleaved = create(sdk, 2_000, max_tokens=2_000,
                         thinking={"type": "enabled", "budget_tokens": 8_000},
                         extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert interleaved.usage.output_tokens == 2_000


def thinking_turns(*later: Any) -> Any:
    """A tool-use turn with thinking (400 bytes: 100 tokens), answered by a tool result."""
    return [
        {"role": "user", "content": "hello"},  # 4 + 2
        {"role": "assistant", "content": [  # 4 + 100 + "f" and "{}" (3 bytes): 1
            {"type": "thinking", "thinking": "t" * 400, "signature": "sig"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [  # 4 + "sunny": 2
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        *later,
    ]


# 6 + 105 + 6 + the reply's 3 + the tools (346 + 12), with the thinking's 100.
THINKING_TURNS_TOKENS = 478


@pytest.mark.parametrize(("model", "kept"), [(SONNET, False), ("claude-opus-4-5", True)])
def test_thinking_sent_back_is_input_while_its_turn_lasts_or_where_the_model_keeps_it(
    sdk: anthropic.Anthropic, model: str, kept: bool
) -> None:
    in_turn = create(sdk, 10, model=model, tools=TOOL_F, messages=thinking_turns())
    assert in_turn.usage.input_tokens == THINKING_TURNS_TOKENS
    later = thinking_turns({"role": "assistant", "content": "done"},  # 4 + 1
                           {"role": "user", "content": "next"})  # 4 + 1
    next_turn = create(sdk, 10, model=model, tools=TOOL_F, messages=later)
    # Sonnet 4.5 drops an earlier turn's thinking; Opus 4.5 keeps every turn's.
    assert next_turn.usage.input_tokens == THINKING_TURNS_TOKENS + 10 - (0 if kept else 100)


def test_the_sdks_own_round_trip_bills_the_thinking_it_sends_back(
    sdk: anthropic.Anthropic,
) -> None:
    first = create(sdk, 200, tools=TOOL_F, max_tokens=2_000,
                   thinking={"type": "enabled", "budget_tokens": 1_024},
                   extra_headers={"X-Stub-Tool-Call": "1"})
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.stop_reason == "tool_use"
    thinking, call = first.content
    result: Any = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,  # type: ignore[union-attr]
                                                "content": "sunny"}]}
    args = {"tools": TOOL_F, "max_tokens": 2_000,
            "thinking": {"type": "enabled", "budget_tokens": 1_024}}
    with_thinking = create(sdk, 10, messages=[*HELLO, first.to_param(), result], **args)
    without = create(sdk, 10, messages=[*HELLO, {"role": "assistant", "content": [call]},
                                        result], **args)
    # The model reads the whole thinking the signature carries, not the summary shown.
    shown = len(thinking.thinking.encode())  # type: ignore[union-attr]
    billed = first.usage.output_tokens_details.thinking_tokens  # type: ignore[union-attr]
    assert billed == 100 > -(-shown // 4)
    assert with_thinking.usage.input_tokens - without.usage.input_tokens == billed


# -- web search (https://platform.claude.com/docs/en/agents-and-tools/tool-use/web-search-tool) -


def test_web_searches_bill_a_fee_each_and_their_results_as_input(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    http.post("/control", json={"web_search_result_tokens": 1_000}).raise_for_status()
    message = create(sdk, 10, tools=WEB_SEARCH, extra_headers={"X-Stub-Web-Searches": "3"})
    kinds = [b.type for b in message.content]
    # Three asked, max_uses 2: two run; the third is refused with max_uses_exceeded.
    assert kinds == ["server_tool_use", "web_search_tool_result"] * 3 + ["text"]
    refused = message.content[5]
    assert refused.type == "web_search_tool_result"
    assert refused.content.error_code == "max_uses_exceeded"  # type: ignore[union-attr]
    usage = message.usage
    assert usage.server_tool_use is not None
    assert usage.server_tool_use.web_search_requests == 2
    # 9 + 346 + the tool's 16 + two searches of 1,000 result tokens.
    assert usage.input_tokens == HELLO_TOKENS + 346 + WEB_SEARCH_TOKENS + 2_000
    # 2,371 x 3 + 10 x 15 + 2 x $0.01 ($10 per 1,000 searches) = 7,113 + 150 + 20,000.
    call = only_call(http)
    assert call.cost_micros == 27_263
    assert call.usage is not None
    assert call.usage.web_search_requests == 2


@pytest.mark.parametrize(("choice", "asked", "searches", "cost"), [
    # A forced search runs once: 9 + 313 (any or tool) + 16 + its 8,000 result tokens, + $0.01.
    ({"type": "tool", "name": "web_search"}, {}, 1, (9 + 313 + 16 + 8_000) * 3 + 150 + 10_000),
    # None runs under tool_choice none, whatever is asked: 9 + 346 + 16.
    ({"type": "none"}, {"X-Stub-Web-Searches": "2"}, 0, (9 + 346 + 16) * 3 + 150),
])
def test_the_tool_choice_decides_the_searches_that_run(
    sdk: anthropic.Anthropic, http: httpx.Client, choice: Any, asked: dict[str, str],
    searches: int, cost: int,
) -> None:
    message = create(sdk, 10, tools=WEB_SEARCH, tool_choice=choice, extra_headers=asked)
    assert message.usage.server_tool_use is not None
    assert (message.usage.server_tool_use.web_search_requests, message.stop_reason) == (
        searches, "end_turn")
    assert only_call(http).cost_micros == cost


def test_search_results_sent_back_are_input_again(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    http.post("/control", json={"web_search_result_tokens": 1_000}).raise_for_status()
    first = create(sdk, 10, tools=WEB_SEARCH, extra_headers={"X-Stub-Web-Searches": "1"})
    use, result = first.content[:2]
    history: Any = [*HELLO, {"role": "assistant", "content": [use, result]},
                    {"role": "user", "content": "thanks"}]
    again = create(sdk, 10, tools=WEB_SEARCH, messages=history,
                   extra_headers={"X-Stub-Web-Searches": "0"})
    # hello 6; the assistant turn 4 + server_tool_use ("web_search" and {"query":"stub
    # search 1"}: 35 bytes -> 9) + the results 1,000; "thanks" 4 + 2; reply 3; tools 362.
    assert again.usage.input_tokens == 6 + 4 + 9 + 1_000 + 6 + 3 + 346 + WEB_SEARCH_TOKENS
    assert again.usage.server_tool_use is not None
    assert again.usage.server_tool_use.web_search_requests == 0


def test_a_stream_reports_search_input_only_in_its_final_usage(http: httpx.Client) -> None:
    http.post("/control", json={"web_search_result_tokens": 1_000}).raise_for_status()
    events, clean = sse_events(http, {"model": SONNET, "max_tokens": 50, "messages": HELLO,
                                      "tools": WEB_SEARCH},
                               forced(10, **{"X-Stub-Web-Searches": "1"}))
    assert clean
    start, delta = events[0], events[-2]
    assert (start["type"], delta["type"]) == ("message_start", "message_delta")
    before = HELLO_TOKENS + 346 + WEB_SEARCH_TOKENS
    assert start["message"]["usage"]["input_tokens"] == before
    assert delta["usage"]["input_tokens"] == before + 1_000
    assert delta["usage"]["server_tool_use"]["web_search_requests"] == 1


# -- long context (https://platform.claude.com/docs/en/about-claude/pricing, long context) -----

LONG_CONTEXT_BETA = {"anthropic-beta": "context-1m-2025-08-07"}


def test_above_200k_input_with_the_1m_beta_the_whole_call_is_billed_at_long_context_rates(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    # 800,400 bytes: 200,100 tokens, + 4 + 3 = 200,107 input tokens.
    big = [{"role": "user", "content": "z" * 800_400}]
    message = create(sdk, 10, messages=big, extra_headers=LONG_CONTEXT_BETA)
    assert message.usage.input_tokens == 200_107
    # Above 200K: input $6, output $22.50: 200,107 x 6 + 10 x 22.5 = 1,200,642 + 225.
    call = only_call(http)
    assert (call.cost_micros, call.service_tier) == (1_200_867, "long_context")
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        create(sdk, 10, messages=big)  # without the beta the window is 200K
    # 199,000 + 7 with the beta: standard rates, 199,007 x 3 + 150.
    create(sdk, 10, messages=[{"role": "user", "content": "z" * 796_000}],
           extra_headers=LONG_CONTEXT_BETA)
    assert costs(http)[-1] == 597_171


def test_input_and_max_tokens_must_fit_the_context_window(http: httpx.Client) -> None:
    body = {"model": SONNET, "messages": [{"role": "user", "content": "z" * 796_000}]}
    assert http.post(MESSAGES, json=body | {"max_tokens": 993}).status_code == 200
    response = http.post(MESSAGES, json=body | {"max_tokens": 994})  # 199,007 + 994 > 200,000
    assert response.status_code == 400
    assert "exceed context limit" in response.json()["error"]["message"]
    over = http.post(MESSAGES, json={"model": "claude-opus-4-1", "max_tokens": 32_001,
                                     "messages": HELLO})
    assert "maximum allowed number of output tokens" in over.json()["error"]["message"]


# -- streams (https://platform.claude.com/docs/en/build-with-claude/streaming) -----------------


def test_a_stream_sends_anthropics_events_in_order(sdk: anthropic.Anthropic) -> None:
    events = list(sdk.messages.create(model=SONNET, max_tokens=100, messages=HELLO, stream=True,
                                      extra_headers=forced(40)))
    kinds = [e.type for e in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]  # 40 words in deltas of 16; ping skipped
    start, stop = events[0], events[-2]
    assert start.type == "message_start"
    assert stop.type == "message_delta"
    assert (start.message.usage.input_tokens, start.message.usage.output_tokens) == (
        HELLO_TOKENS, 1)
    assert start.message.stop_reason is None
    assert (stop.usage.output_tokens, stop.usage.input_tokens, stop.delta.stop_reason) == (
        40, HELLO_TOKENS, "end_turn")
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta"
                   and e.delta.type == "text_delta")
    assert len(text.split(" ")) == 40


def test_the_stream_helper_builds_the_final_message_with_thinking_and_tools(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    with sdk.messages.stream(model=SONNET, max_tokens=3_000, messages=HELLO, tools=TOOL_F,
                             thinking={"type": "enabled", "budget_tokens": 1_024},
                             extra_headers=forced(300, **{"X-Stub-Tool-Call": "1"})) as stream:
        deltas = {e.delta.type for e in stream if e.type == "content_block_delta"}
        final = stream.get_final_message()
    assert deltas == {"thinking_delta", "signature_delta", "input_json_delta"}
    thinking, call = final.content
    assert thinking.type == "thinking"
    assert call.type == "tool_use"
    assert len(str(call.input["text"]).split(" ")) == 150
    assert (final.stop_reason, final.usage.output_tokens) == ("tool_use", 300)
    assert only_call(http).stream


async def test_the_async_client_creates_and_streams(
    asdk: anthropic.AsyncAnthropic, http: httpx.Client
) -> None:
    message = await asdk.messages.create(model=SONNET, max_tokens=100, messages=HELLO,
                                         extra_headers=forced(20))
    assert message.usage.output_tokens == 20
    async with asdk.messages.stream(model=SONNET, max_tokens=100, messages=HELLO,
                                    system=cached_system((LONG, "5m")),
                                    extra_headers=forced(30)) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert len(text.split(" ")) == 30
    assert final.usage.cache_creation_input_tokens == LONG_TOKENS
    # 9 x 3 + 20 x 15 = 327; 1,250 x 3.75 + 27 + 30 x 15 = 5,164.5.
    assert costs(http) == [327, 5_165]


# -- errors (https://platform.claude.com/docs/en/api/errors) ----------------------------------


def test_models_are_served_by_their_own_providers_api(
    sdk: anthropic.Anthropic, provider: StubProvider, http: httpx.Client
) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(model="claude-nope-9", max_tokens=10, messages=HELLO)
    assert missing.value.type == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.create(model="gpt-4o", max_tokens=10, messages=HELLO)
    chat = openai.OpenAI(base_url=f"{provider.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        chat.chat.completions.create(model=SONNET, messages=HELLO)
    assert bill_of(http).total.calls == 0


TOO_MANY_BREAKPOINTS: Any = [{"type": "text", "text": "a",
                              "cache_control": {"type": "ephemeral"}}] * 5
THINKING = {"thinking": {"type": "enabled", "budget_tokens": 1_024}, "max_tokens": 4_000}


def image_refused(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"max_tokens": 10, "messages": image_messages(image_block(data, media_type))}


@pytest.mark.parametrize(("body", "headers", "status", "kind", "why"), [
    ({"max_tokens": 10}, {"anthropic-version": ""}, 400, "invalid_request_error",
     "not a version"),
    ({"max_tokens": 10}, {"x-api-key": "sk-wrong"}, 401, "authentication_error", "x-api-key"),
    # A failure before serving, in the type by status the SDK retries by.
    ({"max_tokens": 10}, {"X-Stub-Fail-Status": "429"}, 429, "rate_limit_error", "stub failure"),
    ({"max_tokens": 10}, {"X-Stub-Fail-Status": "500"}, 500, "api_error", "stub failure"),
    ({"max_tokens": 10}, {"X-Stub-Fail-Status": "529"}, 529, "overloaded_error", "stub failure"),
    ({}, {}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"max_tokens": 10, "n": 2}, {}, 400, "invalid_request_error",
     "Extra inputs are not permitted"),
    ({"max_tokens": 10, "container": "c1"}, {}, 400, "invalid_request_error",
     "not served by the stub"),
    ({"max_tokens": 10, "temperature": 1.5}, {}, 400, "invalid_request_error", "temperature"),
    ({"max_tokens": 10, "messages": []}, {}, 400, "invalid_request_error", "at least one message"),
    ({"max_tokens": 10, "messages": [{"role": "tool", "content": "x"}]}, {}, 400,
     "invalid_request_error", "role"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, {}, 400,
     "invalid_request_error", "not served in a user"),
    ({"max_tokens": 10, "metadata": {"user_id": "u", "tags": []}}, {}, 400,
     "invalid_request_error", "metadata"),
    # Tools and tool_choice.
    ({"max_tokens": 10, "tool_choice": {"type": "auto"}}, {}, 400, "invalid_request_error",
     "only be specified while providing tools"),
    ({"max_tokens": 10, "tools": TOOL_F, "tool_choice": {"type": "tool", "name": "g"}}, {}, 400,
     "invalid_request_error", "not given"),
    ({"max_tokens": 10, "tools": [*TOOL_F, *TOOL_F]}, {}, 400, "invalid_request_error",
     "unique"),
    ({"max_tokens": 10, "tools": [{"name": "f"}]}, {}, 400, "invalid_request_error",
     "input_schema"),
    ({"max_tokens": 10, "tools": [{"type": "bash_20250124", "name": "bash"}]}, {}, 400,
     "invalid_request_error", "not served by the stub"),
    # Images (https://platform.claude.com/docs/en/build-with-claude/vision, "general limits").
    (image_refused(png(8, 8), "image/jpeg"), {}, 400, "invalid_request_error",
     "does not match the provided media type"),
    (image_refused(jpeg(8, 8), "image/png"), {}, 400, "invalid_request_error",
     "does not match the provided media type"),
    (image_refused(png(8, 8), "image/bmp"), {}, 400, "invalid_request_error",
     "media_type must be one of"),
    (image_refused(png(8_001, 10)), {}, 400, "invalid_request_error", "exceed max allowed size"),
    (image_refused(b"not an image"), {}, 400, "invalid_request_error", "not a PNG, JPEG"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "file", "file_id": "file_nope"}}]}]}, {}, 400, "invalid_request_error",
     "Unable to download"),
    # cache_control (https://platform.claude.com/docs/en/build-with-claude/prompt-caching).
    ({"max_tokens": 10, "system": TOO_MANY_BREAKPOINTS}, {}, 400, "invalid_request_error",
     "A maximum of 4 blocks"),
    ({"max_tokens": 10, "system": cached_system(("a", "5m"), ("b", "1h"))}, {}, 400,
     "invalid_request_error", "must not come after"),
    ({"max_tokens": 10, "system": [{"type": "text", "text": "a", "cache_control": {
        "type": "ephemeral", "ttl": "2h"}}]}, {}, 400, "invalid_request_error", "ttl must be"),
    ({"max_tokens": 10, "system": [{"type": "text", "text": "a", "cache_control": {
        "type": "persistent"}}]}, {}, 400, "invalid_request_error", "ephemeral"),
    # Extended thinking (https://platform.claude.com/docs/en/build-with-claude/
    # extended-thinking).
    ({"thinking": {"type": "enabled", "budget_tokens": 500}, "max_tokens": 4_000}, {}, 400,
     "invalid_request_error", "greater than or equal to 1024"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4_000}, "max_tokens": 4_000}, {}, 400,
     "invalid_request_error", "must be greater than"),
    (THINKING | {"temperature": 0.5}, {}, 400, "invalid_request_error", "isn't compatible"),
    (THINKING | {"top_k": 5}, {}, 400, "invalid_request_error", "isn't compatible"),
    (THINKING | {"tools": TOOL_F, "tool_choice": {"type": "any"}}, {}, 400,
     "invalid_request_error", "forces tool use"),
    (THINKING | {"model": "claude-3-5-haiku-20241022"}, {}, 400, "invalid_request_error",
     "not supported"),
    ({"thinking": {"type": "sometimes"}, "max_tokens": 4_000}, {}, 400, "invalid_request_error",
     "thinking"),
    ({"thinking": {"type": "adaptive", "display": "loud"}, "max_tokens": 4_000}, {}, 400,
     "invalid_request_error", "thinking.display"),
    # Context management and output_config
    # (https://platform.claude.com/docs/en/build-with-claude/context-editing, .../effort).
    ({"max_tokens": 10, "context_management": {"edits": [{"type": "clear_everything"}]}}, {},
     400, "invalid_request_error", "context_management.edits[0].type"),
    ({"max_tokens": 10, "context_management": {"edits": [
        {"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}]}}, {}, 400,
     "invalid_request_error", "must be the first edit"),
    ({"max_tokens": 10, "context_management": {"edits": [{"type": "compact_20260112",
                                                          "trigger": {"type": "input_tokens",
                                                                      "value": 1_000}}]}}, {},
     400, "invalid_request_error", "at least 50000"),
    ({"max_tokens": 10, "output_config": {"effort": "extreme"}}, {}, 400,
     "invalid_request_error", "output_config.effort"),
    ({"max_tokens": 10, "output_config": {"format": {"type": "json_object"}}}, {}, 400,
     "invalid_request_error", "json_schema"),
])
def test_what_the_api_refuses_is_refused_unbilled_in_anthropics_shape(
    http: httpx.Client, body: dict[str, Any], headers: dict[str, str], status: int, kind: str,
    why: str,
) -> None:
    response = http.post(MESSAGES, json={"model": SONNET, "messages": HELLO} | body,
                         headers=headers)
    assert response.status_code == status
    doc = response.json()
    assert (doc["type"], doc["error"]["type"]) == ("error", kind)
    assert why in doc["error"]["message"]
    assert response.headers["request-id"] == doc["request_id"]
    assert bill_of(http).total.calls == 0


def test_the_version_header_is_required(provider: StubProvider) -> None:
    response = httpx.post(provider.url + MESSAGES, headers={"x-api-key": KEY},
                          json={"model": SONNET, "max_tokens": 10, "messages": HELLO})
    assert response.status_code == 400
    assert "anthropic-version: header is required" in response.json()["error"]["message"]


def test_a_body_above_32_mb_is_413(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    with pytest.raises(anthropic.APIStatusError) as refused:
        create(sdk, 10, messages=[{"role": "user", "content": "z" * (32 * 1024 * 1024)}])
    assert (refused.value.status_code, refused.value.type) == (413, "request_too_large")
    assert bill_of(http).total.calls == 0


# -- faults after billing, as Anthropic's clients see them ---------------------------------------


def test_the_sdks_retries_of_a_billed_529_are_each_billed(
    provider: StubProvider, http: httpx.Client
) -> None:
    retrying = anthropic.Anthropic(base_url=provider.url, api_key=KEY, max_retries=2)
    http.post("/control", json={"fail_after_billing": 529, "calls": 2}).raise_for_status()
    message = retrying.messages.create(model=SONNET, max_tokens=200, messages=HELLO,
                                       extra_headers=forced(100))
    assert message.usage.output_tokens == 100
    bill = bill_of(http)
    # The SDK retries a 529; the provider billed each attempt: three calls for one answer.
    assert [(c.status, c.cost_micros) for c in bill.log] == [(529, 1_527), (529, 1_527),
                                                             (200, 1_527)]
    assert bill.total.cost_micros == 3 * 1_527


def test_a_stream_that_fails_after_billing_sends_an_error_event(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    body = {"model": SONNET, "max_tokens": 200, "messages": HELLO}
    events, clean = sse_events(http, body, forced(100, **{"X-Stub-Fail-After-Billing": "529"}))
    assert clean  # the stream ends, but with an error and no message_stop
    assert [e["type"] for e in events] == ["message_start", "ping", "error"]
    assert events[-1]["error"]["type"] == "overloaded_error"
    with pytest.raises(anthropic.APIStatusError) as failed, sdk.messages.stream(
        **body, extra_headers=forced(100, **{"X-Stub-Fail-After-Billing": "529"})
    ) as stream:
        stream.until_done()
    assert failed.value.type == "overloaded_error"
    assert [(c.status, c.billed, c.cost_micros) for c in bill_of(http).log] == [
        (529, True, 1_527)] * 2


def test_a_client_that_hangs_up_mid_stream_is_billed_in_full(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    with sdk.messages.stream(model=SONNET, max_tokens=500, messages=HELLO,
                             extra_headers=forced(400)) as stream:
        for seen, _ in enumerate(stream):
            if seen == 3:
                break  # leaving the block closes the connection
    call = only_call(http)
    assert call.usage is not None
    assert (call.usage.output_tokens, call.cost_micros) == (400, 27 + 6_000)



# -- counting without billing ----------------------------------------------------------------


def test_count_tokens_gives_the_input_a_call_bills_and_bills_nothing(
    sdk: anthropic.Anthropic, http: httpx.Client
) -> None:
    args: Any = {"model": SONNET, "system": "Be brief.", "tools": TOOL_F,
                 "messages": image_messages(image_block(png(1000, 1000)))}
    counted = sdk.messages.count_tokens(**args)
    # "Be brief." 9 bytes -> 3; the image frame 11 + 1,334; the tools 346 + 12.
    assert counted.input_tokens == 3 + 11 + 1_334 + 346 + 12
    assert create(sdk, 10, **args).usage.input_tokens == counted.input_tokens
    bill = bill_of(http)
    assert (bill.requests, bill.total.calls) == (2, 1)
    assert (bill.log[0].api, bill.log[0].billed) == ("messages.count_tokens", False)
