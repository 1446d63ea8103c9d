"""Amazon Bedrock's runtime for Claude on the stub provider: the witness for a gateway's Bedrock
upstream.

  POST /model/{modelId}/invoke                       InvokeModel: a Messages answer, as JSON
  POST /model/{modelId}/invoke-with-response-stream  InvokeModelWithResponseStream: the AWS
                                     event stream (application/vnd.amazon.eventstream)
  POST /model/{modelId}/count-tokens CountTokens: {"input": {"invokeModel": {"body": base64 of
                                     an InvokeModel body}}} -> {"inputTokens": N}, the input it
                                     would bill uncached, as /v1/messages/count_tokens counts it;
                                     free, never billed (logged as bedrock.count_tokens)

The body is Anthropic's Messages body as Bedrock takes it
(https://docs.aws.amazon.com/bedrock/latest/userguide/model-parameters-anthropic-claude-messages.html):
`anthropic_version` is required, "bedrock-2023-05-31" or an Anthropic API version date (the
anthropic SDK's Bedrock client sends its own, 2026-10-21 in 2.17); the model is the path's, and a
field Bedrock's Claude body does not take (BODY_FIELDS: a body `model` or `stream`, Anthropic's
`service_tier` or `speed`) is refused 400 as Bedrock refuses it; betas come as the body list
`anthropic_beta` (a header names none), and one Bedrock does not take (BETAS) fails the call 400
"invalid beta flag"; a server tool (web search, web fetch, code execution: Bedrock runs none of
them) is refused 400. The model id is a base id (`anthropic.claude-sonnet-4-5-20250929-v1:0`), a
geographic cross-region profile (`us.`, `eu.`, `apac.`, `jp.`, `au.`, `us-gov.` before it, billed as
the base id: in-region prices), a global profile (`global.anthropic...`, its own, lower, prices), or
an ARN whose last part is one of those; URL-encoded in the path as the SDKs send it. A call is
counted, decided and billed by infra.stub_messages (its rules, its faults, its X-Stub-* headers), at
the stub table's entry of that Bedrock id (infra/stub_prices.json, source "bedrock"): the bill logs
that entry as the model and the id sent as `model_requested` when they differ. Headers that would
bill at rates the table does not hold are refused (400): a service tier other than `default`
(X-Amzn-Bedrock-Service-Tier: flex, priority, reserved), latency-optimized inference
(X-Amzn-Bedrock-PerformanceConfig-Latency: optimized), a guardrail
(X-Amzn-Bedrock-GuardrailIdentifier).

Authentication: SigV4 (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_sigv-create-signed-request.html),
verified: the stub computes the signature of the request it received with botocore's SigV4Auth
(service `bedrock`, the configured region) from the known secret key and compares. A missing or
malformed Authorization header, an unknown access key or session token, a scope of another
region or service, an X-Amz-Date more than 5 minutes from the stub's clock, or a signature that
does not match is refused 403 in AWS's shape, unbilled. The credentials are the /control setting
`bedrock_credentials` {"access_key_id", "secret_access_key", "session_token" (optional),
"region", "api_key" (optional)}, by default AWS's documented example key pair in us-east-1
(BEDROCK_CREDENTIALS_DEFAULT). A Bedrock API key
(https://docs.aws.amazon.com/bedrock/latest/userguide/api-keys.html) is taken instead of a
signature as `Authorization: Bearer <key>` when `api_key` is set; any other bearer token is
refused 403 AccessDeniedException (the stub's wording).

Answers: InvokeModel's body is the Messages answer (`id` msg_bdrk_..., `model` the Anthropic
name, `usage` as Anthropic reports it) with the token counts also in the headers
X-Amzn-Bedrock-Input-Token-Count (the uncached input, Anthropic's `input_tokens`),
-Output-Token-Count, -Cache-Read-Input-Token-Count and -Cache-Write-Input-Token-Count. The stream
is one `chunk` event a Messages stream event (no pings), its `bytes` the event's JSON in base64;
message_stop carries `amazon-bedrock-invocationMetrics` {inputTokenCount, outputTokenCount,
invocationLatency, firstByteLatency, cacheReadInputTokenCount, cacheWriteInputTokenCount}, the
same counts as the headers (the stub reports latencies of 0). The framing is the stub's own
encoder (botocore only decodes), checked against botocore's EventStream decoder, boto3 and the
anthropic SDK's AnthropicBedrock in tests/infra/test_stub_bedrock.py.

Errors (https://docs.aws.amazon.com/bedrock/latest/APIReference/API_runtime_InvokeModel.html):
`{"message": ...}` with the error's name in the `x-amzn-ErrorType` header, as botocore reads it:
ValidationException 400 (a bad body; an unknown model id: "The provided model identifier is
invalid."), AccessDeniedException 403, ResourceNotFoundException 404, ThrottlingException 429,
InternalServerException 500, ServiceUnavailableException 503, and the signature's own 403s. A
stream that fails after it was billed (fail_after_billing) sends message_start and then an
exception event (`:message-type: exception`): throttlingException for 429,
internalServerException for 500, serviceUnavailableException for 503, else
modelStreamErrorException with the status as `originalStatusCode`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import re
import secrets
import struct
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from infra.stub_faults import Api, ApiError, Fault
from infra.stub_messages import API_VERSION, REQUEST_BYTES_MAX, MessagesApi, Reply
from infra.stub_messages import FIELDS as MESSAGES_FIELDS
from infra.stub_prices import ModelPrices

if TYPE_CHECKING:
    from infra.stub_provider import StubProviderApp

API_NAME = "bedrock.invoke"
API_COUNT_TOKENS = "bedrock.count_tokens"
# Request headers that would change what a call bills, and the one value the stub serves of
# each (absent is served too): Bedrock's flex and priority tiers, latency-optimized inference,
# and guardrails (billed per text unit) would each bill at rates the table does not hold.
PRICED_HEADERS = {"x-amzn-bedrock-service-tier": "default",
                  "x-amzn-bedrock-performanceconfig-latency": "standard",
                  "x-amzn-bedrock-guardrailidentifier": ""}
BEDROCK_API_VERSION = "bedrock-2023-05-31"
# The InvokeModel body's fields for Claude (model-parameters-anthropic-claude-messages-request-
# response, its thinking, context management and structured-output pages): any other is refused
# as Bedrock refuses it ("extraneous key [...] is not permitted"), Anthropic's own `model`,
# `stream`, `service_tier`, `speed`, `inference_geo`, `container`, `mcp_servers` and a
# top-level `cache_control` included (Bedrock names the model and the stream in the path and
# takes its tier as a header).
BODY_FIELDS = frozenset({"anthropic_version", "anthropic_beta", "max_tokens", "messages",
                         "system", "temperature", "top_p", "top_k", "stop_sequences", "tools",
                         "tool_choice", "thinking", "metadata", "context_management",
                         "output_config"})
# Anthropic's server tools (run and billed by the provider), by their type's prefix: Bedrock runs
# none of them and refuses a call that declares one.
SERVER_TOOLS_REFUSED = ("web_search_", "web_fetch_", "code_execution_")
# The `anthropic_beta` values Bedrock takes for Claude: the list of Bedrock's Claude
# request-response page,
# https://docs.aws.amazon.com/bedrock/latest/userguide/model-parameters-anthropic-claude-messages-request-response.html
# ("anthropic_beta"), and Claude Code's identification, which Bedrock accepts. Any other fails
# the call 400 "invalid beta flag", as Bedrock fails it. Kept from that page, not from the
# gateway's list (api/upstreams/cloud_messages.py BEDROCK_BETAS), which a test holds to be
# within this one (tests/api/upstreams/test_cloud_betas.py). Anthropic's advanced-tool-use
# beta is Bedrock's tool search and tool examples betas; Anthropic's later betas (prompt
# caching's scope, per-turn control, thinking token counts) are not among them.
BETAS = frozenset({"computer-use-2024-10-22", "computer-use-2025-01-24",
                   "token-efficient-tools-2025-02-19", "interleaved-thinking-2025-05-14",
                   "output-128k-2025-02-19", "dev-full-thinking-2025-05-14",
                   "context-1m-2025-08-07", "context-management-2025-06-27",
                   "effort-2025-11-24", "tool-search-tool-2025-10-19",
                   "tool-examples-2025-10-29", "claude-code-20250219"})
SIGNING_SERVICE = "bedrock"
SIGNING_ALGORITHM = "AWS4-HMAC-SHA256"
# AWS refuses a request signed more than 5 minutes from its own clock, either way
# (https://docs.aws.amazon.com/IAM/latest/UserGuide/signing-elements.html, "date").
SIGNATURE_SKEW_S_MAX = 5 * 60
AMZ_DATE_FORMAT = "%Y%m%dT%H%M%SZ"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
# AWS's documented example credentials (https://docs.aws.amazon.com/IAM/latest/UserGuide/
# security-creds.html): a key pair that is nobody's, so a test never holds a real one.
BEDROCK_CREDENTIALS_DEFAULT = {"access_key_id": "AKIAIOSFODNN7EXAMPLE",
                               "secret_access_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                               "region": "us-east-1"}
CONTROL_FIELDS = frozenset({"bedrock_credentials"})
# Geographic cross-region inference profiles: billed as the base model id, at in-region prices
# (https://docs.aws.amazon.com/bedrock/latest/userguide/inference-profiles-support.html).
GEO_PREFIXES = frozenset({"us", "eu", "apac", "jp", "au", "us-gov", "ca", "in"})
MODEL_ID = re.compile(r"[A-Za-z0-9._:-]{1,256}")
# Bedrock's error names by status, in the x-amzn-ErrorType header; other 4xx ValidationException,
# other 5xx InternalServerException.
ERROR_TYPES = {400: "ValidationException", 403: "AccessDeniedException",
               404: "ResourceNotFoundException", 408: "ModelTimeoutException",
               424: "ModelErrorException", 429: "ThrottlingException",
               500: "InternalServerException", 503: "ServiceUnavailableException"}
# The exception events a stream reports a failure with, by status; others modelStreamError.
STREAM_EXCEPTIONS = {429: "throttlingException", 500: "internalServerException",
                     503: "serviceUnavailableException"}
ERROR_TYPE_SUFFIX = ":http://internal.amazon.com/coral/com.amazon.bedrock/"
EVENT_STREAM_MEDIA_TYPE = "application/vnd.amazon.eventstream"
# The event stream's framing (https://docs.aws.amazon.com/transcribe/latest/dg/event-stream.html):
# a prelude of total and headers length and its CRC32, headers, payload, a CRC32 of it all.
PRELUDE_BYTES = 12
MESSAGE_CRC_BYTES = 4
HEADER_TYPE_STRING = 7
# Messages events Bedrock does not forward.
EVENTS_DROPPED = frozenset({"ping"})
INVOCATION_METRICS = "amazon-bedrock-invocationMetrics"


@dataclass(frozen=True)
class BedrockCredentials:
    """The one AWS identity the stub's Bedrock accepts."""

    access_key_id: str
    secret_access_key: str
    region: str
    session_token: str | None = None
    api_key: str | None = None  # a Bedrock API key, sent as a bearer token; None: none works

    @classmethod
    def from_json(cls, doc: object) -> BedrockCredentials:
        keys = {"access_key_id", "secret_access_key", "region"}
        if (not isinstance(doc, Mapping) or not keys <= set(doc)
                or set(doc) - keys - {"session_token", "api_key"}
                or not all(isinstance(v, str) and v for v in doc.values())):
            raise ValueError("bedrock_credentials is {access_key_id, secret_access_key, region, "
                             "session_token and api_key (optional)}, each a non-empty string")
        return cls(doc["access_key_id"], doc["secret_access_key"], doc["region"],
                   doc.get("session_token"), doc.get("api_key"))

    def to_json(self) -> dict[str, str | None]:
        """As /control shows them: the secrets left out."""
        return {"access_key_id": self.access_key_id, "region": self.region,
                "session_token": None if self.session_token is None else "(set)",
                "api_key": None if self.api_key is None else "(set)"}


def refused(exception: str, message: str, status: int = 403) -> ApiError:
    """An authentication refusal, AWS's exception name as its code."""
    return ApiError(status, message, code=exception)


def verify_sigv4(method: str, host: str, raw_path: str, query: str,
                 headers: Mapping[str, str], body: bytes, credentials: BedrockCredentials,
                 now_s: float) -> None:
    """Raise an ApiError (403, AWS's exception name as its code) unless the request was signed
    by `credentials` for Bedrock in their region within SIGNATURE_SKEW_S_MAX of `now_s`.

    The signature is recomputed by botocore's SigV4Auth over the headers the request says it
    signed, as received: the canonical request is botocore's, so whatever botocore signs the
    same way (boto3, the anthropic SDK) is verified exactly."""
    authorization = headers.get("authorization")
    if authorization is None:
        raise refused("MissingAuthenticationTokenException", "Missing Authentication Token")
    algorithm, _, rest = authorization.partition(" ")
    fields = dict(part.strip().partition("=")[::2] for part in rest.split(","))
    if (algorithm != SIGNING_ALGORITHM
            or not {"Credential", "SignedHeaders", "Signature"} <= set(fields)):
        raise refused("IncompleteSignatureException",
                      "Authorization header requires 'Credential', 'Signature' and "
                      f"'SignedHeaders' parameters, signed with {SIGNING_ALGORITHM}.")
    scope = fields["Credential"].split("/")
    if len(scope) != 5 or scope[4] != "aws4_request":
        raise refused("IncompleteSignatureException",
                      f"Credential is malformed: {fields['Credential']!r}")
    access_key, day, region, service, _ = scope
    if access_key != credentials.access_key_id:
        raise refused("UnrecognizedClientException",
                      "The security token included in the request is invalid.")
    if headers.get("x-amz-security-token") != credentials.session_token:
        raise refused("UnrecognizedClientException",
                      "The security token included in the request is invalid.")
    amz_date = headers.get("x-amz-date", "")
    try:
        signed_at = datetime.strptime(amz_date, AMZ_DATE_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        raise refused("IncompleteSignatureException",
                      "Authorization header requires existence of either a 'X-Amz-Date' or a "
                      "'Date' header.") from None
    if region != credentials.region:
        raise refused("InvalidSignatureException",
                      f"Credential should be scoped to a valid region, not '{region}'.")
    if service != SIGNING_SERVICE:
        raise refused("InvalidSignatureException",
                      f"Credential should be scoped to correct service: '{SIGNING_SERVICE}'.")
    if day != amz_date[:8]:
        raise refused("InvalidSignatureException",
                      f"Date in Credential scope does not match YYYYMMDD from ISO-8601 version "
                      f"of date from HTTP: '{day}' != '{amz_date[:8]}'")
    skew_s = now_s - signed_at.timestamp()
    if abs(skew_s) > SIGNATURE_SKEW_S_MAX:
        now = datetime.fromtimestamp(now_s, UTC).strftime(AMZ_DATE_FORMAT)
        raise refused("InvalidSignatureException",
                      f"Signature expired: {amz_date} is now earlier than {now} - 5 min."
                      if skew_s > 0 else
                      f"Signature not yet current: {amz_date} is still later than {now} + 5 min.")
    content_sha256 = headers.get("x-amz-content-sha256")
    if content_sha256 not in (None, UNSIGNED_PAYLOAD, hashlib.sha256(body).hexdigest()):
        raise refused("InvalidSignatureException",
                      "The provided 'x-amz-content-sha256' header does not match what was "
                      "computed.", 400)
    signed = fields["SignedHeaders"].split(";")
    if "host" not in signed or any(name not in headers for name in signed):
        raise refused("InvalidSignatureException",
                      "The request signature we calculated does not match the signature you "
                      "provided: a signed header is missing.")
    url = f"http://{host}{raw_path}" + (f"?{query}" if query else "")
    request = AWSRequest(method=method, url=url, headers={n: headers[n] for n in signed},
                         data=body)
    request.context["timestamp"] = amz_date
    signer = SigV4Auth(Credentials(credentials.access_key_id, credentials.secret_access_key,
                                   credentials.session_token), SIGNING_SERVICE, region)
    canonical = signer.canonical_request(request)
    expected = signer.signature(signer.string_to_sign(request, canonical), request)
    if not hmac.compare_digest(expected, fields["Signature"]):
        raise refused("InvalidSignatureException",
                      "The request signature we calculated does not match the signature you "
                      "provided. Check your AWS Secret Access Key and signing method. Consult "
                      "the service documentation for details.")


# -- the event stream ----------------------------------------------------------------------------


def event_message(headers: list[tuple[str, str]], payload: bytes) -> bytes:
    """One message of the AWS event stream: string headers and a payload, with both CRCs."""
    head = b"".join(
        struct.pack(">B", len(name.encode())) + name.encode()
        + struct.pack(">BH", HEADER_TYPE_STRING, len(value.encode())) + value.encode()
        for name, value in headers)
    total = PRELUDE_BYTES + len(head) + len(payload) + MESSAGE_CRC_BYTES
    prelude = struct.pack(">II", total, len(head))
    prelude += struct.pack(">I", binascii.crc32(prelude))
    message = prelude + head + payload
    return message + struct.pack(">I", binascii.crc32(message))


def chunk_event(doc: dict[str, Any]) -> bytes:
    """A `chunk` event carrying one Messages stream event, as Bedrock frames it."""
    data = base64.b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode()
    return event_message([(":event-type", "chunk"), (":content-type", "application/json"),
                          (":message-type", "event")],
                         json.dumps({"bytes": data}, separators=(",", ":")).encode())


def exception_event(status: int, message: str) -> bytes:
    """An exception event: the stream's way of failing after its 200."""
    name = STREAM_EXCEPTIONS.get(status, "modelStreamErrorException")
    doc: dict[str, Any] = {"message": message}
    if name == "modelStreamErrorException":
        doc |= {"originalStatusCode": status, "originalMessage": message}
    return event_message([(":exception-type", name), (":content-type", "application/json"),
                          (":message-type", "exception")],
                         json.dumps(doc, separators=(",", ":")).encode())


def refuse_server_tools(body: dict[str, Any], refused: tuple[str, ...]) -> None:
    """ApiError 400 for a declared tool whose type starts with one of `refused`: a server tool
    the cloud does not run (and so never bills)."""
    tools = body.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind.startswith(refused):
            label = kind.rsplit("_", 1)[0].replace("_", " ")
            raise ApiError(400, f"tools.{index}: {label} is not available on this platform "
                           f"({kind})")


def invoke_body_of(raw: bytes) -> dict[str, Any]:
    """The InvokeModel body a CountTokens request holds: `input.invokeModel.body`, base64."""
    try:
        doc = json.loads(raw)
        body = json.loads(base64.b64decode(doc["input"]["invokeModel"]["body"], validate=True))
    except (ValueError, KeyError, TypeError) as exc:
        raise ApiError(400, "input.invokeModel.body must be an InvokeModel body, base64 "
                       "(the stub does not count Converse inputs)") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "input.invokeModel.body must be a JSON object")
    return body


def _sse_doc(event: bytes) -> dict[str, Any]:
    """The JSON of one SSE event infra.stub_messages made."""
    data = next(line for line in event.split(b"\n") if line.startswith(b"data: "))
    doc = json.loads(data[len(b"data: "):])
    assert isinstance(doc, dict)
    return doc


# -- the API -------------------------------------------------------------------------------------


def priced_id(model_id: str) -> str:
    """The table entry a model id is billed at: an ARN's last part, a geographic profile's base
    id; a global profile and a base id as they are."""
    name = model_id.rsplit("/", 1)[-1] if model_id.startswith("arn:") else model_id
    prefix, _, rest = name.partition(".")
    return rest if prefix in GEO_PREFIXES and rest.startswith("anthropic.") else name


def anthropic_name(entry: str) -> str:
    """The name a Bedrock answer's `model` gives: Anthropic's, as Bedrock reports it."""
    name = entry.removeprefix("global.").removeprefix("anthropic.")
    return re.sub(r"-v\d+(:\d+)?$", "", name)


class Bedrock:
    """What Bedrock's routes share: the credentials, and a Messages API of its own (its prompt
    cache is not Anthropic's)."""

    def __init__(self, app: StubProviderApp) -> None:
        self.app = app
        self.credentials = BedrockCredentials.from_json(BEDROCK_CREDENTIALS_DEFAULT)
        self.messages = MessagesApi(app)
        self.invoke = BedrockApi(self, stream=False)
        self.invoke_stream = BedrockApi(self, stream=True)

    def reset(self) -> None:
        self.messages.reset()

    def routes(self) -> list[Route]:
        return [Route("/model/{model_id:path}/invoke", self.invoke.serve, methods=["POST"]),
                Route("/model/{model_id:path}/invoke-with-response-stream",
                      self.invoke_stream.serve, methods=["POST"]),
                Route("/model/{model_id:path}/count-tokens", self.count_tokens,
                      methods=["POST"])]

    async def count_tokens(self, request: Request) -> Response:
        """CountTokens: the input an InvokeModel body would bill with nothing cached. Signed as
        every call is; free, never billed."""
        self.app.bill.requests += 1
        api = self.invoke
        headers = api.headers()
        model_id = api.model_of({}, request)
        try:
            raw = await api.read_raw(request)
            api.check(request)
            body = invoke_body_of(raw)
            messages_body, _ = api.messages_body(body, model_id or "")
            managed = self.messages.counted(messages_body, MESSAGES_FIELDS)
        except ApiError as exc:
            self.app.log(API_COUNT_TOKENS, model_id, exc.status, False, Fault())
            return api.error(exc, headers)
        self.app.log(API_COUNT_TOKENS, model_id, 200, False, Fault())
        return JSONResponse({"inputTokens": managed.prompt.tokens}, headers=headers)

    def control(self, doc: Mapping[str, Any]) -> BedrockCredentials | None:
        """The credentials /control sets (ValueError), None when it sets none."""
        if "bedrock_credentials" not in doc:
            return None
        return BedrockCredentials.from_json(doc["bedrock_credentials"])


class BedrockApi(Api[Reply]):
    """InvokeModel (`stream` False) or InvokeModelWithResponseStream, on infra.stub_messages."""

    name = API_NAME
    request_bytes_max = REQUEST_BYTES_MAX

    def __init__(self, bedrock: Bedrock, *, stream: bool) -> None:
        self.bedrock = bedrock
        self.stream = stream
        if stream:
            self.stream_media_type = EVENT_STREAM_MEDIA_TYPE

    async def serve(self, request: Request) -> Response:
        """Read the body first, which the signature covers, then serve as every API is."""
        with contextlib.suppress(ApiError):  # check() answers for the missing body
            await self.read_raw(request)
        return await self.bedrock.app.serve(self, request)

    async def read_raw(self, request: Request) -> bytes:
        """The body's bytes, kept for check() to verify the signature over."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > REQUEST_BYTES_MAX:
            raise ApiError(413, f"Request exceeds the maximum size of {REQUEST_BYTES_MAX} bytes")
        try:
            request.state.raw_body = await request.body()
        except ClientDisconnect as exc:
            raise ApiError(499, "the client went away", "client_disconnected") from exc
        return bytes(request.state.raw_body)

    def headers(self) -> dict[str, str]:
        headers = {"x-amzn-RequestId": str(uuid.uuid4())}
        if self.stream:
            headers["X-Amzn-Bedrock-Content-Type"] = "application/json"
        return headers

    def error(self, error: ApiError, headers: dict[str, str]) -> Response:
        # refused() names AWS's exception in `code`, capitalized as AWS spells it; any other
        # error (the Messages API's, a fault's) is named by its status.
        kind = error.code if error.code[:1].isupper() else ERROR_TYPES.get(
            error.status, "ValidationException" if error.status < 500
            else "InternalServerException")
        return JSONResponse({"message": error.message}, status_code=error.status,
                            headers={**headers, "x-amzn-ErrorType": kind + ERROR_TYPE_SUFFIX})

    def check(self, request: Request) -> set[str]:
        raw = getattr(request.state, "raw_body", None)
        if raw is None:
            length = request.headers.get("content-length", "")
            if length.isdigit() and int(length) > REQUEST_BYTES_MAX:
                raise ApiError(413, f"Request exceeds the maximum size of {REQUEST_BYTES_MAX} "
                               "bytes")
            raise ApiError(499, "the client went away", "client_disconnected")
        authorization = request.headers.get("authorization", "")
        if authorization.startswith("Bearer "):
            api_key = self.bedrock.credentials.api_key
            if api_key is None or not hmac.compare_digest(
                    authorization.removeprefix("Bearer ").encode(), api_key.encode()):
                raise refused("AccessDeniedException",
                              "Authentication failed: Please make sure your API Key is valid.")
            return set()
        verify_sigv4(request.method, request.headers.get("host", ""),
                     request.scope["raw_path"].decode("latin-1"),
                     request.scope["query_string"].decode("latin-1"), request.headers, raw,
                     self.bedrock.credentials, time.time())
        return set()  # betas are the body's `anthropic_beta`

    def model_of(self, body: dict[str, Any], request: Request) -> str | None:
        return str(request.path_params["model_id"])

    def streams(self, body: dict[str, Any], request: Request) -> bool:
        return self.stream

    def _model(self, model_id: str) -> tuple[str, ModelPrices]:
        entry = priced_id(model_id)
        prices = self.bedrock.app.prices.model(entry) if MODEL_ID.fullmatch(entry) else None
        if prices is None or prices.messages is None:
            raise ApiError(400, "The provided model identifier is invalid.")
        return prices.name, prices

    def decide(self, body: dict[str, Any], request: Request, fault: Fault,
               betas: set[str]) -> Reply:
        model_id = self.model_of(body, request) or ""
        for header, served in PRICED_HEADERS.items():
            if request.headers.get(header, served) != served:
                raise ApiError(400, f"{header}: {request.headers[header]!r} is not served by "
                               "the stub (it would bill at other rates)")
        messages_body, betas = self.messages_body(body, model_id)
        reply = self.bedrock.messages.decide(messages_body, request, fault, betas)
        entry = messages_body["model"]
        return replace(reply, model_requested=None if model_id == entry else model_id,
                       message_id="msg_bdrk_" + secrets.token_hex(12))

    def messages_body(self, body: dict[str, Any], model_id: str) -> tuple[dict[str, Any],
                                                                          set[str]]:
        """An InvokeModel body as infra.stub_messages takes it, and its betas (ApiError when
        Bedrock refuses it): the model the table entry of the path's id."""
        for key in body:
            if key not in BODY_FIELDS:
                raise ApiError(400, f"Malformed input request: #: extraneous key [{key}] is not "
                               "permitted, please reformat your input and try again.")
        version = body.get("anthropic_version")
        if version != BEDROCK_API_VERSION and not (isinstance(version, str)
                                                   and API_VERSION.fullmatch(version)):
            raise ApiError(400, "Malformed input request: #/anthropic_version: "
                           + ("required key [anthropic_version] not found" if version is None
                              else f"{version!r} is not {BEDROCK_API_VERSION!r}")
                           + ", please reformat your input and try again.")
        beta_list = body.get("anthropic_beta", [])
        if not isinstance(beta_list, list) or not all(isinstance(b, str) for b in beta_list):
            raise ApiError(400, "Malformed input request: #/anthropic_beta: expected type: "
                           "JSONArray of strings, please reformat your input and try again.")
        if any(beta.strip() not in BETAS for beta in beta_list):
            raise ApiError(400, "invalid beta flag")
        refuse_server_tools(body, SERVER_TOOLS_REFUSED)
        entry, _ = self._model(model_id)
        messages_body = {k: v for k, v in body.items()
                         if k not in ("anthropic_version", "anthropic_beta")}
        return {**messages_body, "model": entry}, {b.strip() for b in beta_list if b.strip()}

    def charged(self, decided: Reply, fault: Fault) -> None:
        self.bedrock.messages.charged(decided, fault)

    def reset(self) -> None:
        pass  # Bedrock.reset empties the shared prompt cache once

    def _counts(self, decided: Reply) -> dict[str, int]:
        """The token counts Bedrock reports, by their invocationMetrics names."""
        usage = self.bedrock.messages.body(decided)["usage"]
        return {"inputTokenCount": usage["input_tokens"],
                "outputTokenCount": usage["output_tokens"],
                "cacheReadInputTokenCount": usage["cache_read_input_tokens"],
                "cacheWriteInputTokenCount": usage["cache_creation_input_tokens"]}

    def answer_headers(self, decided: Reply) -> dict[str, str]:
        if self.stream:
            return {}
        counts = self._counts(decided)
        return {"X-Amzn-Bedrock-Input-Token-Count": str(counts["inputTokenCount"]),
                "X-Amzn-Bedrock-Output-Token-Count": str(counts["outputTokenCount"]),
                "X-Amzn-Bedrock-Cache-Read-Input-Token-Count":
                    str(counts["cacheReadInputTokenCount"]),
                "X-Amzn-Bedrock-Cache-Write-Input-Token-Count":
                    str(counts["cacheWriteInputTokenCount"]),
                "X-Amzn-Bedrock-Invocation-Latency": "0"}

    def body(self, decided: Reply) -> dict[str, Any]:
        return {**self.bedrock.messages.body(decided), "model": anthropic_name(decided.model)}

    def _chunks(self, events: list[bytes], decided: Reply) -> list[bytes]:
        chunks = []
        for event in events:
            doc = _sse_doc(event)
            if doc["type"] in EVENTS_DROPPED:
                continue
            if doc["type"] == "message_start":
                doc["message"]["model"] = anthropic_name(decided.model)
            if doc["type"] == "message_stop":
                doc[INVOCATION_METRICS] = {**self._counts(decided), "invocationLatency": 0,
                                           "firstByteLatency": 0}
            chunks.append(chunk_event(doc))
        return chunks

    def events(self, decided: Reply, fault: Fault) -> list[bytes]:
        return self._chunks(self.bedrock.messages.events(decided, fault), decided)

    def failed_events(self, decided: Reply, failure: ApiError) -> list[bytes]:
        started = [e for e in self.bedrock.messages.failed_events(decided, failure)
                   if _sse_doc(e)["type"] != "error"]
        return [*self._chunks(started, decided), exception_event(failure.status,
                                                                 failure.message)]
