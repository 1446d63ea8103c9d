"""Vertex AI on the stub provider: Google's Gemini and Anthropic's Claude behind a service
account's OAuth token, the witness for a gateway's `vertex` upstream. The Gemini API itself is
infra/stub_gemini.py's, Claude's Messages API infra/stub_messages.py's: this module adds Vertex's
paths, its authentication and its Claude envelope.

  POST /{v1|v1beta1}/projects/{project}/locations/{region}/publishers/google/models/{model}
       :generateContent | :streamGenerateContent?alt=sse | :countTokens
      Gemini as on the Gemini API (same table, same prices: Vertex bills these models at the
      Gemini API's rates), usageMetadata with `trafficType: ON_DEMAND`, answers with createTime
  POST /{v1|v1beta1}/projects/{project}/locations/{region}/publishers/anthropic/models/{model}
       :rawPredict | :streamRawPredict
      Claude: Anthropic's Messages body with `anthropic_version` "vertex-2023-10-16" (or an API
      version date: the anthropic SDK 2.x sends its own, "2026-10-21") and no
      `model` (the path names it: `claude-sonnet-4-5@20250929`, billed as the table's
      `claude-sonnet-4-5-20250929` or `claude-sonnet-4-5`); betas by the `anthropic-beta`
      header only, each one Vertex takes (BETAS; any other refused 400, unbilled), and no body
      field Vertex refuses (FIELDS_REFUSED: `anthropic_beta`, `speed`, `inference_geo`) nor a
      server tool it does not run (web fetch, code execution; web search it runs and bills);
      served, priced and answered by the Messages API's own
      code (its prompt cache, thinking, tools, faults), in Anthropic's error shape but for a
      refused token (Google's); a regional endpoint bills Sonnet 4.5 and later models 10% above
      the global one (`locations/global`), as Anthropic documents
  POST /token                     the OAuth 2.0 JWT-bearer grant
                                  (urn:ietf:params:oauth:grant-type:jwt-bearer): an assertion
                                  signed RS256 by the stub's service account, `aud` Google's
                                  token endpoint (what google-auth signs, whatever `token_uri`
                                  says) or this URL, `exp` not passed, living at most an hour;
                                  answers a random token valid 1 hour (else 400 invalid_grant)
  GET  /vertex/service_account    the service account's JSON (a key made at start, private key
                                  included; `token_uri` this stub's /token), for google-auth's
                                  service_account.Credentials and AnthropicVertex

Every Vertex call needs `Authorization: Bearer <token from /token>`; a wrong or expired one
(the app's clock: /control's clock_offset_s expires it) is refused 401 UNAUTHENTICATED, unbilled.
The bill logs the APIs as `vertex.gemini` and `vertex.messages`; Claude's
`.../publishers/anthropic/models/count-tokens:rawPredict` (Anthropic's count_tokens body, its
`model` a Vertex id; free) as `vertex.count_tokens`.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import secrets
import time
from collections import OrderedDict
from dataclasses import replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from infra.stub_bedrock import refuse_server_tools
from infra.stub_faults import Api, ApiError, Fault, read_body
from infra.stub_gemini import (
    CONTROL_FIELDS,
    VERSIONS,
    GeminiApi,
    GeminiSettings,
    google_error,
    invalid,
    serve,
)
from infra.stub_messages import API_VERSION, REQUEST_BYTES_MAX, MessagesApi, Reply

if TYPE_CHECKING:
    from infra.stub_provider import StubProviderApp

__all__ = ["CONTROL_FIELDS", "GoogleRoutes", "VertexAuth", "VertexClaudeApi"]

API_VERTEX_CLAUDE = "vertex.messages"
CLAUDE_ACTIONS = ("rawPredict", "streamRawPredict")
VERTEX_ANTHROPIC_VERSION = "vertex-2023-10-16"
API_VERTEX_COUNT_TOKENS = "vertex.count_tokens"
# Claude's token count on Vertex: the `count-tokens` model's rawPredict, Anthropic's
# count_tokens body (its `model` the Vertex id) in and its answer out; free.
COUNT_TOKENS_TARGET = "count-tokens:rawPredict"
# The `anthropic-beta` values Vertex takes for Claude: Google's Claude page,
# https://cloud.google.com/vertex-ai/generative-ai/docs/partner-models/claude, with Anthropic's
# https://platform.claude.com/docs/en/build-with-claude/claude-on-vertex-ai and its feature
# pages' Vertex notes (the tool search beta is Vertex's name for Anthropic's advanced-tool-use,
# tool examples its second part), and Claude Code's identification. Any other is refused 400 as
# Vertex refuses it, before anything is billed. Kept from those pages, not from the gateway's
# list (api/upstreams/cloud_messages.py VERTEX_BETAS), which a test holds to be within this one
# (tests/api/upstreams/test_cloud_betas.py). Anthropic's later betas (prompt
# caching's scope, per-turn control, thinking token counts, fast mode) are not among them.
BETAS = frozenset({"computer-use-2024-10-22", "computer-use-2025-01-24",
                   "token-efficient-tools-2025-02-19", "interleaved-thinking-2025-05-14",
                   "output-128k-2025-02-19", "context-1m-2025-08-07",
                   "context-management-2025-06-27", "effort-2025-11-24",
                   "tool-search-tool-2025-10-19", "tool-examples-2025-10-29",
                   "claude-code-20250219"})
# Body fields of Anthropic's API that Vertex refuses: betas come as the header, and fast mode
# and the inference geography are Anthropic's own API's.
FIELDS_REFUSED = ("anthropic_beta", "speed", "inference_geo")
# Anthropic's server tools Vertex does not run, by their type's prefix (it runs web search, billed
# per search as Anthropic bills it): a call that declares one is refused.
SERVER_TOOLS_REFUSED = ("web_fetch_", "code_execution_")
# Vertex's API versions: v1, and v1beta1 (google-genai's default for Vertex).
VERTEX_VERSIONS = ("v1", "v1beta1")
# Claude on Vertex from Sonnet 4.5 on costs 10% more at a regional endpoint than at the global
# one (https://platform.claude.com/docs/en/build-with-claude/claude-on-vertex-ai, "global vs
# regional endpoints"; earlier models keep one price): the table's models of that age, by name.
GLOBAL_REGION = "global"
REGIONAL_PREMIUM = Fraction(11, 10)
REGIONAL_PREMIUM_MODELS = frozenset({"claude-sonnet-4-5", "claude-haiku-4-5", "claude-opus-4-5",
                                     "claude-sonnet-5-5", "claude-opus-5-5"})

# OAuth: the grant google-auth makes for a service account, the audience it signs (Google's token
# endpoint, whatever token_uri says), and the tokens' life.
JWT_BEARER_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"
GOOGLE_TOKEN_AUDIENCE = "https://oauth2.googleapis.com/token"  # noqa: S105 (a URL)
ACCESS_TOKEN_TTL_S = 3_600
# Google refuses an assertion that lives longer than an hour, and allows this much clock skew.
ASSERTION_LIFETIME_S_MAX = 3_600
CLOCK_SKEW_S = 300
ACCESS_TOKENS_MAX = 10_000
SERVICE_ACCOUNT_EMAIL = "stub-provider@stub-project.iam.gserviceaccount.com"
SERVICE_ACCOUNT_PROJECT = "stub-project"
RSA_KEY_BITS = 2_048
# A token request has two fields; a body with more is not one.
FORM_FIELDS_MAX = 10


# -- the service account and its tokens --------------------------------------------------------


def _b64url(data: str) -> bytes:
    return base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))


class VertexAuth:
    """The stub's one service account (a key made at start) and the access tokens POST /token
    issued for it, expiring by the app's clock (so /control's clock_offset_s expires them)."""

    def __init__(self, app: StubProviderApp) -> None:
        self.app = app
        self.key = rsa.generate_private_key(public_exponent=65_537, key_size=RSA_KEY_BITS)
        self.key_id = secrets.token_hex(20)
        self.tokens: OrderedDict[str, float] = OrderedDict()  # token: expires at (app clock)

    def service_account(self, token_uri: str) -> dict[str, str]:
        pem = self.key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()).decode()
        return {"type": "service_account", "project_id": SERVICE_ACCOUNT_PROJECT,
                "private_key_id": self.key_id, "private_key": pem,
                "client_email": SERVICE_ACCOUNT_EMAIL, "client_id": "1",
                "token_uri": token_uri, "universe_domain": "googleapis.com"}

    async def service_account_route(self, request: Request) -> Response:
        return JSONResponse(self.service_account(str(request.url_for("vertex_token"))))

    async def token_route(self, request: Request) -> Response:
        """The JWT-bearer grant: verify the assertion, answer a token (or invalid_grant)."""
        # Parsed here: starlette's form parser needs python-multipart, which the stub does not.
        form = {k: v[0] for k, v in parse_qs((await request.body()).decode(errors="replace"),
                                             max_num_fields=FORM_FIELDS_MAX).items()}
        try:
            if form.get("grant_type") != JWT_BEARER_GRANT:
                raise ValueError(f"grant_type must be {JWT_BEARER_GRANT}")
            assertion = form.get("assertion")
            if not isinstance(assertion, str):
                raise ValueError("no assertion")
            self.verify(assertion, str(request.url_for("vertex_token")))
        except ValueError as exc:
            return JSONResponse({"error": "invalid_grant", "error_description": str(exc)},
                                status_code=400)
        token = "ya29.stub-" + secrets.token_urlsafe(32)
        self.tokens[token] = self.app.now_s() + ACCESS_TOKEN_TTL_S
        while len(self.tokens) > ACCESS_TOKENS_MAX:
            self.tokens.popitem(last=False)
        return JSONResponse({"access_token": token, "expires_in": ACCESS_TOKEN_TTL_S,
                             "token_type": "Bearer"})

    def verify(self, assertion: str, own_uri: str) -> None:
        """An RS256 JWT signed by the service account's key, for a token endpoint, not expired
        and living at most an hour (ValueError otherwise)."""
        try:
            head_b64, payload_b64, signature_b64 = assertion.split(".")
            head = json.loads(_b64url(head_b64))
            payload = json.loads(_b64url(payload_b64))
            signature = _b64url(signature_b64)
        except (ValueError, binascii.Error) as exc:
            raise ValueError("the assertion is not a JWT") from exc
        if not isinstance(head, dict) or head.get("alg") != "RS256" or not isinstance(
                payload, dict):
            raise ValueError("the assertion must be signed RS256")
        if payload.get("iss") != SERVICE_ACCOUNT_EMAIL:
            raise ValueError(f"no service account {payload.get('iss')!r}")
        try:
            self.key.public_key().verify(signature, f"{head_b64}.{payload_b64}".encode(),
                                         padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature as exc:
            raise ValueError("Invalid JWT Signature.") from exc
        if payload.get("aud") not in (GOOGLE_TOKEN_AUDIENCE, own_uri):
            raise ValueError(f"Invalid JWT: aud {payload.get('aud')!r}")
        now_s = time.time()
        issued, expires = payload.get("iat"), payload.get("exp")
        if type(issued) is not int or type(expires) is not int:
            raise ValueError("Invalid JWT: iat and exp are required")
        if expires < now_s - CLOCK_SKEW_S or issued > now_s + CLOCK_SKEW_S:
            raise ValueError("Invalid JWT: Token must be a short-lived token (60 minutes) and "
                             "in a reasonable timeframe")
        if expires - issued > ASSERTION_LIFETIME_S_MAX:
            raise ValueError("Invalid JWT: the assertion lives longer than an hour")

    def check(self, request: Request) -> None:
        """A bearer token this endpoint issued and that has not expired (401 otherwise)."""
        header = request.headers.get("authorization", "")
        token = header[len("Bearer "):] if header.startswith("Bearer ") else None
        expires = self.tokens.get(token) if token is not None else None
        if expires is None or expires <= self.app.now_s():
            raise ApiError(401, "Request had invalid authentication credentials. Expected OAuth "
                           "2 access token, login cookie or other valid authentication "
                           "credential.")


# -- Claude on Vertex --------------------------------------------------------------------------


class VertexClaudeApi(Api[Reply]):
    """rawPredict and streamRawPredict: the Messages API's own handling (infra.stub_messages)
    of the body with the path's model, behind Vertex's token; billed there, logged here."""

    name = API_VERTEX_CLAUDE

    request_bytes_max = REQUEST_BYTES_MAX

    def __init__(self, app: StubProviderApp, auth: VertexAuth) -> None:
        self.app, self.auth = app, auth

    @property
    def messages(self) -> MessagesApi:
        """The app's Messages API, which serves every Claude call (made after this API)."""
        return self.app.messages

    def headers(self) -> dict[str, str]:
        return self.messages.headers()

    def error(self, error: ApiError, headers: dict[str, str]) -> Response:
        if error.status == 401:  # Google's front door refused the token
            return google_error(error, headers)
        return self.messages.error(error, headers)

    def check(self, request: Request) -> set[str]:
        self.auth.check(request)
        if GeminiApi.target(request)[1] not in CLAUDE_ACTIONS:
            raise ApiError(404, "Claude on Vertex serves rawPredict and streamRawPredict")
        betas = {beta.strip() for header in request.headers.getlist("anthropic-beta")
                 for beta in header.split(",") if beta.strip()}
        unknown = sorted(betas - BETAS)
        if unknown:
            raise invalid(f"Unexpected value(s) `{', '.join(unknown)}` for the `anthropic-beta` "
                          "header. Please consult our documentation at docs.anthropic.com or "
                          "try again without the header.")
        return betas

    def model_of(self, body: dict[str, Any], request: Request) -> str | None:
        return GeminiApi.target(request)[0]

    def streams(self, body: dict[str, Any], request: Request) -> bool:
        return GeminiApi.target(request)[1] == "streamRawPredict"

    def priced_name(self, vertex_id: str) -> str:
        """A Vertex model id (`claude-sonnet-4-5@20250929`) as the table prices it: the id
        itself, the dated name Anthropic uses (`-` for `@`), or the undated name."""
        prices = self.app.prices
        for name in (vertex_id, vertex_id.replace("@", "-"), vertex_id.partition("@")[0]):
            model = prices.model(name)
            if model is not None and model.messages is not None:
                return name
        raise ApiError(404, f"Publisher Model `{vertex_id}` was not found or your project does "
                       "not have access to it.")

    def decide(self, body: dict[str, Any], request: Request, fault: Fault,
               betas: set[str]) -> Reply:
        version = body.get("anthropic_version")
        if version != VERTEX_ANTHROPIC_VERSION and not (
                isinstance(version, str) and API_VERSION.fullmatch(version)):
            raise invalid(f"anthropic_version: must be {VERTEX_ANTHROPIC_VERSION!r} or an API "
                          "version date")
        if "model" in body:
            raise invalid("model: Extra inputs are not permitted (Vertex names it in the path)")
        for key in FIELDS_REFUSED:
            if key in body:
                raise invalid(f"{key}: Extra inputs are not permitted")
        refuse_server_tools(body, SERVER_TOOLS_REFUSED)
        messages_body = {k: v for k, v in body.items() if k != "anthropic_version"}
        messages_body["model"] = self.priced_name(GeminiApi.target(request)[0])
        messages_body["stream"] = self.streams(body, request)
        reply = self.messages.decide(messages_body, request, fault, betas)
        if request.path_params["region"] == GLOBAL_REGION or (
                reply.prices.name not in REGIONAL_PREMIUM_MODELS):
            return reply
        # The premium on the whole call, rounded up once more (at most a micro-dollar above
        # the exact sum).
        cost = math.ceil(reply.cost_micros * REGIONAL_PREMIUM)
        return replace(reply, cost_micros=cost, beyond_body={
            **(reply.beyond_body or {}), "regional_premium_micros": cost - reply.cost_micros})

    def charged(self, decided: Reply, fault: Fault) -> None:
        self.messages.charged(decided, fault)

    def body(self, decided: Reply) -> dict[str, Any]:
        return self.messages.body(decided)

    def events(self, decided: Reply, fault: Fault) -> list[bytes]:
        return self.messages.events(decided, fault)

    def failed_events(self, decided: Reply, failure: ApiError) -> list[bytes] | None:
        return self.messages.failed_events(decided, failure)


# -- the routes -------------------------------------------------------------------------------


class GoogleRoutes:
    """Everything the Gemini API and Vertex AI add to the app: their APIs, routes, token endpoint
    and /control settings (`controlled` checks them, `apply` sets them)."""

    def __init__(self, app: StubProviderApp) -> None:
        self.app = app
        self.settings = GeminiSettings()
        self.auth = VertexAuth(app)
        self.gemini = GeminiApi(app, self.settings)
        self.vertex = GeminiApi(app, self.settings, self.auth.check)
        self.claude = VertexClaudeApi(app, self.auth)
        self.controlled, self.apply = self.settings.controlled, self.settings.apply
        self.to_json = self.settings.to_json

    def routes(self) -> list[Route]:
        vertex = "/{version}/projects/{project}/locations/{region}/publishers"
        return [
            *(Route(f"/{version}/models/{{target}}", self.serve_gemini, methods=["POST"])
              for version in VERSIONS),
            Route(vertex + "/google/models/{target}", self.serve_vertex, methods=["POST"]),
            Route(vertex + "/anthropic/models/{target}", self.serve_claude, methods=["POST"]),
            Route("/token", self.auth.token_route, methods=["POST"], name="vertex_token"),
            Route("/vertex/service_account", self.auth.service_account_route, methods=["GET"]),
        ]

    async def serve_gemini(self, request: Request) -> Response:
        return await serve(self.app, self.gemini, request)

    async def serve_vertex(self, request: Request) -> Response:
        if request.path_params["version"] not in VERTEX_VERSIONS:
            return google_error(ApiError(404, "Not Found"))
        return await serve(self.app, self.vertex, request)

    async def serve_claude(self, request: Request) -> Response:
        if request.path_params["version"] not in VERTEX_VERSIONS:
            return google_error(ApiError(404, "Not Found"))
        if request.path_params["target"] == COUNT_TOKENS_TARGET:
            return await self.count_claude(request)
        return await self.app.serve(self.claude, request)

    async def count_claude(self, request: Request) -> Response:
        """count-tokens:rawPredict: the Messages API's count_tokens of the body, its `model` a
        Vertex id (priced_name), behind the token and the betas check; free, never billed."""
        self.app.bill.requests += 1
        claude = self.claude
        headers = claude.headers()
        model: str | None = None
        try:
            self.auth.check(request)
            claude.check(request)
            body = await read_body(request, REQUEST_BYTES_MAX)
            if isinstance(body.get("model"), str):
                model = body["model"]
            for key in FIELDS_REFUSED:
                if key in body:
                    raise invalid(f"{key}: Extra inputs are not permitted")
            managed = self.app.messages.counted({**body, "model": claude.priced_name(
                str(body.get("model")))})
        except ApiError as exc:
            self.app.log(API_VERTEX_COUNT_TOKENS, model, exc.status, False, Fault())
            return claude.error(exc, headers)
        self.app.log(API_VERTEX_COUNT_TOKENS, model, 200, False, Fault())
        return JSONResponse({"input_tokens": managed.prompt.tokens}, headers=headers)
