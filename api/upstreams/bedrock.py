"""Claude on Amazon Bedrock, behind the gateway's Messages route: the anthropic SDK's (and
Claude Code's) calls, held and settled as Anthropic's are, sent to Bedrock's runtime.

A call's Messages body becomes an InvokeModel body (Bedrock's Claude parameters,
https://docs.aws.amazon.com/bedrock/latest/userguide/model-parameters-anthropic-claude-messages.html):
no `model` (the path names it) or `stream` (the path says it), `anthropic_version`
"bedrock-2023-05-31", and the `anthropic-beta` header's betas in the body's `anthropic_beta`
list (Bedrock reads no beta header), each as Bedrock names it and only those it takes
(api/upstreams/cloud_messages.py). It goes to POST /model/{model id}/invoke, or
/invoke-with-response-stream, signed with SigV4 by botocore (service `bedrock`).

The answers are turned back into Anthropic's: InvokeModel's body is a Messages answer already,
its `usage` Anthropic's; the stream's AWS event-stream frames (decoded by botocore), each a
`chunk` whose `bytes` are one Messages stream event, become Anthropic's server-sent events
(`event: <type>` / `data: <json>`), so the gateway's Messages tally and the client read the
stream they would from Anthropic; an exception frame (Bedrock's way of failing a stream after
its 200) breaks the stream off: Unanswered, its hold kept (the call may have been billed).
Errors (`{"message"}`, named in x-amzn-ErrorType) keep their status and get Anthropic's shape,
so the SDK raises the class it would for Anthropic's. CountTokens counts a Messages
count_tokens body, free, its answer in Anthropic's shape.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from api.upstreams.base import CloudUpstream
from api.upstreams.cloud_messages import (
    BEDROCK_BETAS,
    BETA_HEADER,
    SSE_CONTENT_TYPE,
    cloud_body,
    cloud_messages_body,
    error_as_anthropic,
    headers_for,
)
from core.config import ConfigError
from core.formats import Api, Plan
from core.upstream import Headers, NotSent, Sent, Unanswered
from core.upstreams import UpstreamDef

if TYPE_CHECKING:
    import httpx

BEDROCK_VERSION = "bedrock-2023-05-31"  # the InvokeModel body's `anthropic_version`
SIGNING_SERVICE = "bedrock"  # SigV4's service name for bedrock-runtime
# The client's headers that the body now carries or Bedrock does not read: not forwarded.
HEADERS_NOT_FORWARDED = frozenset({"anthropic-version", BETA_HEADER})
# Bedrock's answer headers the client gets beside the common ones: its token counts and its
# error's name (x-amzn-requestid is relayed as Anthropic's request-id, which the SDK reads).
BEDROCK_HEADERS_RELAYED = ("x-amzn-bedrock-", "x-amzn-errortype")
# A count's body: CountTokens takes an InvokeModel body, which needs an output cap; a count
# generates nothing, so any cap counts the same.
COUNT_MAX_TOKENS = 1


def endpoint(definition: UpstreamDef) -> str:
    """Bedrock's runtime endpoint in the upstream's region, unless its base_url overrides it."""
    return definition.base_url or f"https://bedrock-runtime.{definition.region}.amazonaws.com"


class BedrockUpstream(CloudUpstream):
    """A `bedrock` upstream (core/upstreams.py): Claude through InvokeModel and
    InvokeModelWithResponseStream, SigV4-signed."""

    headers_relayed = BEDROCK_HEADERS_RELAYED

    def __init__(self, definition: UpstreamDef, timeout_s: float, **kwargs: Any) -> None:
        if definition.signing_credentials is None or definition.region is None:
            raise ConfigError(f"upstream {definition.name!r}: a bedrock upstream needs a region "
                              "and AWS credentials")
        from botocore.auth import SigV4Auth  # deferred: botocore is a cold start's share
        from botocore.credentials import Credentials

        super().__init__(endpoint(definition), None, timeout_s, **kwargs)
        self.name = definition.name
        self._signer = SigV4Auth(Credentials(*definition.signing_credentials), SIGNING_SERVICE,
                                 definition.region)

    def signed(self, url: str, content: bytes) -> list[tuple[str, str]]:
        """SigV4's headers for a POST of `content` to `url`, which is signed as it is sent."""
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method="POST", url=url, data=content,
                             headers={"content-type": "application/json"})
        self._signer.add_auth(request)
        return [(k, v) for k, v in request.headers.items() if k.lower() != "content-type"]

    def url(self, model_id: str, action: str) -> str:
        # The id quoted as the SDKs send it (an ARN's slashes escaped); the transport sends
        # the URL as yarl writes it, so it is signed as yarl wrote it.
        return str(self.prepared_at(
            f"{self.base_url}/model/{quote(model_id, safe=':')}/{action}").url)

    async def open(self, call_plan: Plan) -> httpx.Response:
        call_plan = replace(call_plan, headers=headers_for(call_plan.headers, BEDROCK_BETAS))
        model_id, content = cloud_messages_body(call_plan, BEDROCK_VERSION, betas_in_body=True)
        url = self.url(model_id, "invoke-with-response-stream" if call_plan.stream
                       else "invoke")
        headers = (*self.signed(url, content),
                   *((k, v) for k, v in call_plan.headers
                     if k.lower() not in HEADERS_NOT_FORWARDED))
        return await self.post(self.prepared_at(url), content, headers)

    def finished(self, call_plan: Plan, sent: Sent) -> Sent:
        """An error in Anthropic's shape, a stream as Anthropic's events."""
        if sent[0] >= 400:
            return error_as_anthropic(sent)
        if isinstance(sent[2], bytes):
            return sent  # InvokeModel's answer is a Messages answer
        return (sent[0], {**sent[1], "content-type": SSE_CONTENT_TYPE},
                anthropic_events(sent[2]))

    def relayed(self, response: httpx.Response) -> dict[str, str]:
        """Also Bedrock's request id as Anthropic's `request-id`, which the SDK reads."""
        headers = super().relayed(response)
        request_id = response.headers.get("x-amzn-requestid")
        if request_id is not None:
            headers["request-id"] = request_id
        return headers

    async def count(self, api: Api, content: bytes, headers: Headers, model: str = "") -> Sent:
        """Bedrock's CountTokens for a Messages count_tokens body: {"input_tokens": N} as
        Anthropic answers it; Unanswered for any failure. The model id is the body's."""
        try:
            body = json.loads(content)
            model_id = str(body["model"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise Unanswered("a count_tokens body names its model") from exc
        body.setdefault("max_tokens", COUNT_MAX_TOKENS)
        body = cloud_body(body, headers_for(headers, BEDROCK_BETAS), BEDROCK_VERSION,
                          betas_in_body=True)
        counted = json.dumps({"input": {"invokeModel": {
            "body": base64.b64encode(json.dumps(body).encode()).decode()}}}).encode()
        url = self.url(model_id, "count-tokens")
        try:
            response = await self.post(self.prepared_at(url), counted, self.signed(url, counted))
        except NotSent as exc:  # a count holds no money: no failure is more than Unanswered
            raise Unanswered(str(exc)) from exc
        sent = (response.status_code, self.relayed(response),
                await self.error_body(response))
        if sent[0] >= 400:
            return error_as_anthropic(sent)
        try:
            tokens = json.loads(sent[2])["inputTokens"]
        except (ValueError, KeyError, TypeError) as exc:
            raise Unanswered("CountTokens answered no inputTokens") from exc
        return (sent[0], {**sent[1], "content-type": "application/json"},
                json.dumps({"input_tokens": tokens}).encode())


async def anthropic_events(chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """Bedrock's event stream as Anthropic's server-sent events; Unanswered when it breaks off,
    ends in an exception frame or cannot be decoded. Closing it frees the connection."""
    from botocore.eventstream import EventStreamBuffer, ParserError

    frames = EventStreamBuffer()
    try:
        async for chunk in chunks:
            frames.add_data(chunk)
            events = []
            try:
                for message in frames:
                    events.append(sse_event(message.headers, message.payload))
            except ParserError as exc:
                raise Unanswered(f"Bedrock's event stream could not be read: {exc}") from exc
            out = b"".join(events)
            if out:
                yield out
    finally:
        await chunks.aclose()


def sse_event(headers: dict[str, Any], payload: bytes) -> bytes:
    """One event-stream message as Anthropic's event: a `chunk` carries one Messages stream
    event, base64 in its `bytes`; an exception (or error) frame ends the stream, Unanswered."""
    kind = headers.get(":message-type")
    if kind != "event":
        name = headers.get(":exception-type") or headers.get(":error-code") or kind
        raise Unanswered(f"Bedrock's stream ended in {name}: "
                         f"{payload.decode(errors='replace')[:500]}")
    if headers.get(":event-type") != "chunk":
        return b""  # an event Bedrock may add that carries no Messages event
    try:
        data = base64.b64decode(json.loads(payload)["bytes"], validate=True)
        doc = json.loads(data)
        event_type = str(doc["type"])
    except (ValueError, KeyError, TypeError) as exc:
        raise Unanswered("a Bedrock chunk that is not a Messages stream event") from exc
    if b"\n" in data or b"\r" in data:  # an event's data is one line
        data = json.dumps(doc).encode()
    return b"event: " + event_type.encode() + b"\ndata: " + data + b"\n\n"


client = BedrockUpstream  # the bedrock kind's (core/upstream_kinds/bedrock.py)
