"""What the cloud upstreams share: api/upstream.py's pooled HTTP client, with a path of its own
for each call (the cloud APIs name the model in the path) and headers made for each call (a
signature, a token); and Claude's Messages body as the clouds take it.

Each cloud upstream is an api.upstream.Upstream: its answers are read (whole, an error's up to
its bound, a stream's chunks) and its failures sorted (NotSent, Unanswered, AnswerTooLarge) by
that class's code; a subclass says only where a call goes, with what, and how the answer is
turned into what the gateway's format reads.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from api.upstream import Upstream, relayed_headers
from core.formats import Api, Plan
from core.upstream import NotSent, Sent, Unanswered

if TYPE_CHECKING:
    import httpx

    from api.transport import Prepared

# Anthropic's error types by status, for a cloud's error turned into Anthropic's shape: the
# anthropic SDK picks its exception class by status and shows `error.type` and `message`.
ANTHROPIC_ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}
# A cloud's paths name one of the upstream's models each: prepared once per path, and no more
# paths kept than this (a call names a model its upstream serves, resolved before it is sent).
PATHS_PREPARED_MAX = 256
# The content type of an Anthropic Messages stream, as Anthropic sends it.
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


class CloudUpstream(Upstream):
    """An api.upstream.Upstream whose answers a subclass may relay more headers of
    (`headers_relayed`) and turn into its format's shapes (`finished`), and whose calls may go
    to a path made per call (`prepared_at`, `post`) with headers made per call."""

    # The answer's headers the client gets beside api/upstream.py's, by prefix.
    headers_relayed: tuple[str, ...] = ()

    def __init__(self, base_url: str, auth: tuple[str, str] | None, timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(base_url, auth, timeout_s, **kwargs)
        self.base_url = base_url.rstrip("/")
        self._paths: dict[str, Prepared] = {}

    async def send(self, call_plan: Plan, deadline_s: float) -> Sent:
        """core.upstream.Upstream.send as api/upstream.py's, the answer then `finished`."""
        try:
            async with asyncio.timeout_at(deadline_s):
                response = await self.open(call_plan)
                if response.status_code < 400 and not call_plan.stream:
                    return self.finished(call_plan, await self.answer(call_plan, response))
        except TimeoutError as exc:
            raise Unanswered(f"no complete answer within {self.timeout_s} s") from exc
        return self.finished(call_plan, await self.answer(call_plan, response))

    def finished(self, call_plan: Plan, sent: Sent) -> Sent:
        """The answer as the client and the gateway's format read it; as it came, by default."""
        del call_plan
        return sent

    def relayed(self, response: httpx.Response) -> dict[str, str]:
        """The answer's headers the client gets."""
        headers = relayed_headers(response)
        if self.headers_relayed:
            for name, value in response.headers.items():
                if name.startswith(self.headers_relayed):
                    headers[name] = value
        return headers

    def prepared_at(self, url: str) -> Prepared:
        """The request to `url`: the client's own headers and timeouts, at that URL."""
        found = self._paths.get(url)
        if found is None:
            from yarl import URL  # with aiohttp, the transport's own

            # Every path shares the headers and timeouts the client prepared for its routes.
            found = replace(self._prepared[Api.MESSAGES], url=URL(url))
            if len(self._paths) < PATHS_PREPARED_MAX:
                self._paths[url] = found
        return found

    async def post(self, prepared: Prepared, content: bytes,
                   headers: Iterable[tuple[str, str]]) -> httpx.Response:
        """Send `content` to `prepared`; NotSent / Unanswered as api/upstream.py sorts them."""
        try:
            return await self._transport.send(prepared, content, headers)
        except self._never_sent as exc:
            raise NotSent(_why(exc)) from exc
        except self._failed as exc:
            raise Unanswered(_why(exc)) from exc

    async def answer(self, call_plan: Plan, response: httpx.Response) -> Sent:
        """The Sent of `response` as api/upstream.py reads it (the caller holds the deadline
        for a complete answer)."""
        headers = self.relayed(response)
        if response.status_code >= 400:
            return (response.status_code, headers, await self.error_body(response))
        if call_plan.stream:
            return (response.status_code, headers, self.chunks(response))
        return (response.status_code, headers, await self.read(response))


def _why(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def cloud_messages_body(call_plan: Plan, anthropic_version: str, *,
                        betas_in_body: bool) -> tuple[str, bytes]:
    """(the model, the body) of a Messages call as a cloud takes it: the model goes in the path,
    so the body has no `model` (nor `stream`: the path says that too), and names the cloud's
    API version. `betas_in_body`: the `anthropic-beta` header's betas go in the body's
    `anthropic_beta` list (Bedrock reads no header)."""
    body = dict(call_plan.body)
    model = str(body.pop("model", call_plan.model))
    body.pop("stream", None)
    body["anthropic_version"] = anthropic_version
    if betas_in_body:
        betas = [beta.strip() for name, value in call_plan.headers
                 if name.lower() == "anthropic-beta" for beta in value.split(",")
                 if beta.strip()]
        if betas:
            body["anthropic_beta"] = list(dict.fromkeys([*body.get("anthropic_beta", ()),
                                                         *betas]))
    return model, replace(call_plan, body=body).content()


def anthropic_error(status: int, message: str) -> bytes:
    """An error body in Anthropic's shape, for a cloud's error in its own."""
    return json.dumps({"type": "error", "error": {
        "type": ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500
                                          else "invalid_request_error"),
        "message": message}}).encode()


def gemini_action(stream: bool) -> str:
    """A Gemini call's method in its path: its stream as server-sent events, as the SDKs ask."""
    return "streamGenerateContent?alt=sse" if stream else "generateContent"


def error_message(doc: object) -> str | None:
    """The message of a cloud's error body, parsed: AWS's {"message"} ({"Message"} on some),
    Google's {"error": {"message"}}; None for one of neither shape."""
    if not isinstance(doc, dict):
        return None
    inner = doc.get("error")
    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
        return str(inner["message"])
    for key in ("message", "Message"):
        if isinstance(doc.get(key), str):
            return str(doc[key])
    return None


def error_as_anthropic(sent: Sent) -> Sent:
    """An error's Sent with its body in Anthropic's shape (unless it is already), so that the
    anthropic SDK raises it as it would Anthropic's own."""
    assert isinstance(sent[2], bytes)
    try:
        doc = json.loads(sent[2])
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("type") == "error":
        return sent
    message = (error_message(doc) or sent[2].decode(errors="replace").strip()
               or f"the provider answered {sent[0]}")
    headers = {**sent[1], "content-type": "application/json"}
    return (sent[0], headers, anthropic_error(sent[0], message))
