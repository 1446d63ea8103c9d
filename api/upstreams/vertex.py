"""Vertex AI: Gemini and Claude, as a service account, at a project's region.

  Gemini  POST {endpoint}/v1/projects/{project}/locations/{region}/publishers/google/models/
          {model}:generateContent | :streamGenerateContent?alt=sse | :countTokens
          the Gemini API's body as the gateway priced it (Plan.content, with any cap it set),
          answers, streams and errors in Google's shapes, as the Gemini format reads them
  Claude  POST .../publishers/anthropic/models/{model}:rawPredict | :streamRawPredict
          the Messages body without `model` (the path names it, `claude-sonnet-4-5@20250929`),
          `stream` or a client's `anthropic_beta`, `anthropic_version` "vertex-2023-10-16",
          and in the `anthropic-beta` header the betas the gateway checked that Vertex takes,
          by Vertex's names (api/upstreams/cloud_messages.py);
          answers and streams are Anthropic's, and an error in Google's shape (a refused
          token) is given Anthropic's, for the anthropic SDK

The endpoint is `https://{region}-aiplatform.googleapis.com` (`https://aiplatform.googleapis.com`
for region `global`) unless the upstream's base_url overrides it. Each call carries
`Authorization: Bearer` with an OAuth token of the service account in `credentials_file` (scope
cloud-platform), which google-auth gets from the file's token_uri: refreshed off the event loop
(its HTTP is blocking) when it is about to expire, once for all the calls waiting, and kept
for the upstream's every call. A token that cannot be had is NotSent: the call never left. A token
Vertex refuses (401) is dropped, so the next call gets a new one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from datetime import UTC
from typing import TYPE_CHECKING, Any

from api.upstreams.base import CloudUpstream
from api.upstreams.cloud_messages import (
    VERTEX_BETAS,
    cloud_messages_body,
    error_as_anthropic,
    headers_for,
)
from api.upstreams.gemini import gemini_action
from core.config import ConfigError
from core.formats import Api, Plan
from core.upstream import Headers, NotSent, Sent, Unanswered
from core.upstreams import UpstreamDef

if TYPE_CHECKING:
    import httpx

VERTEX_VERSION = "vertex-2023-10-16"  # Claude's body's `anthropic_version` on Vertex
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
# A token is refreshed this long before Google says it expires: a call that takes it must still
# be answered within it (google-auth's own margin is 3 min 45 s; calls last minutes at most).
TOKEN_REFRESH_MARGIN_S = 300.0
# The Messages headers the body carries instead (its version) or Vertex takes as they are.
CLAUDE_HEADERS_NOT_FORWARDED = frozenset({"anthropic-version"})


def endpoint(definition: UpstreamDef) -> str:
    if definition.base_url:
        return definition.base_url
    if definition.region == "global":
        return "https://aiplatform.googleapis.com"
    return f"https://{definition.region}-aiplatform.googleapis.com"


class VertexUpstream(CloudUpstream):
    """A `vertex` upstream (core/upstreams.py): the Messages route's calls go to Claude, every
    other route's (Gemini's) to Gemini."""

    def __init__(self, definition: UpstreamDef, timeout_s: float, **kwargs: Any) -> None:
        if not (definition.project and definition.region and definition.credentials_file):
            raise ConfigError(f"upstream {definition.name!r}: a vertex upstream needs its "
                              "project, region and credentials_file")
        from google.oauth2 import service_account  # deferred: a cold start's share

        super().__init__(endpoint(definition), None, timeout_s, **kwargs)
        self.name = definition.name
        self.publishers_url = (f"{self.base_url}/v1/projects/{definition.project}/locations/"
                               f"{definition.region}/publishers")
        try:
            self._credentials = service_account.Credentials.from_service_account_file(  # type: ignore[no-untyped-call]
                definition.credentials_file, scopes=[CLOUD_PLATFORM_SCOPE])
        except (OSError, ValueError) as exc:
            raise ConfigError(f"upstream {definition.name!r}: credentials_file is not a "
                              f"service account's JSON key ({exc})") from exc
        self._token: str | None = None
        self._token_expires_s = 0.0  # time.time() past which the token is refreshed
        self._refresh_task: asyncio.Future[None] | None = None
        self._google_http: Any = None  # google-auth's HTTP, made with the first token

    async def token(self) -> str:
        """The service account's access token, refreshed if it is about to expire; NotSent if
        none can be had (the call is then never sent).

        One refresh at a time, shared by every call waiting for it, and shielded: a call that
        gives up waiting (its deadline) leaves the refresh running for the others."""
        if self._token is None or time.time() >= self._token_expires_s:
            if self._refresh_task is None or self._refresh_task.done():
                self._refresh_task = asyncio.ensure_future(asyncio.to_thread(self._refresh))
                # Its failure is every waiter's; read here too, in case none is left to.
                self._refresh_task.add_done_callback(
                    lambda task: task.cancelled() or task.exception())
            await asyncio.shield(self._refresh_task)
        assert self._token is not None
        return self._token

    def _refresh(self) -> None:
        """google-auth's refresh (blocking HTTP to the key's token_uri), in a worker thread."""
        from google.auth.exceptions import GoogleAuthError

        try:
            if self._google_http is None:
                import urllib3
                from google.auth.transport.urllib3 import Request

                self._google_http = Request(urllib3.PoolManager())  # type: ignore[no-untyped-call]
            self._credentials.refresh(self._google_http)
        except (GoogleAuthError, OSError, ValueError) as exc:
            raise NotSent(f"no access token for Vertex AI from the service account: {exc}") \
                from exc
        expiry = self._credentials.expiry  # naive UTC, as google-auth keeps it
        expires_s = (expiry.replace(tzinfo=UTC).timestamp() if expiry is not None
                     else time.time() + TOKEN_REFRESH_MARGIN_S * 2)
        self._token = str(self._credentials.token)
        self._token_expires_s = expires_s - TOKEN_REFRESH_MARGIN_S

    async def send(self, call_plan: Plan, deadline_s: float) -> Sent:
        try:
            async with asyncio.timeout_at(deadline_s):
                await self.token()
        except TimeoutError as exc:
            raise NotSent("no access token for Vertex AI in time") from exc
        return await super().send(call_plan, deadline_s)

    async def open(self, call_plan: Plan) -> httpx.Response:
        token = await self.token()
        auth = ("authorization", f"Bearer {token}")
        if call_plan.api is Api.MESSAGES:
            call_plan = replace(call_plan, headers=headers_for(call_plan.headers, VERTEX_BETAS))
            model, content = cloud_messages_body(call_plan, VERTEX_VERSION, betas_in_body=False)
            action = "streamRawPredict" if call_plan.stream else "rawPredict"
            url = f"{self.publishers_url}/anthropic/models/{model}:{action}"
            headers = (auth, *((k, v) for k, v in call_plan.headers
                               if k.lower() not in CLAUDE_HEADERS_NOT_FORWARDED))
        else:
            url = (f"{self.publishers_url}/google/models/{call_plan.model_sent}:"
                   f"{gemini_action(call_plan.stream)}")
            content = call_plan.content()
            headers = (auth, *call_plan.headers)
        return await self.post(self.prepared_at(url), content, headers)

    def finished(self, call_plan: Plan, sent: Sent) -> Sent:
        """A refused token is dropped; Claude's errors get Anthropic's shape."""
        if sent[0] == 401:
            self._token = None
        if sent[0] >= 400 and call_plan.api is Api.MESSAGES:
            return error_as_anthropic(sent)
        return sent

    async def count(self, api: Api, content: bytes, headers: Headers, model: str = "") -> Sent:
        """Claude's count: Vertex's count-tokens:rawPredict, the body (its `model` included)
        as Anthropic's count_tokens takes it; Gemini's by `model` (count_gemini). Unanswered
        for any failure."""
        if api is not Api.MESSAGES:
            return await self.count_gemini(model, content)
        return await self._count(f"{self.publishers_url}/anthropic/models/count-tokens:rawPredict",
                                 content, headers_for(headers, VERTEX_BETAS))

    async def count_gemini(self, model: str, content: bytes) -> Sent:
        """Gemini's :countTokens for `model`, free; Unanswered for any failure."""
        return await self._count(f"{self.publishers_url}/google/models/{model}:countTokens",
                                 content, ())

    async def _count(self, url: str, content: bytes, headers: Headers) -> Sent:
        try:
            token = await self.token()
            response = await self.post(self.prepared_at(url), content, (
                ("authorization", f"Bearer {token}"), *headers))
        except NotSent as exc:  # a count holds no money: no failure is more than Unanswered
            raise Unanswered(str(exc)) from exc
        sent = (response.status_code, self.relayed(response),
                await self.error_body(response))
        if sent[0] == 401:
            self._token = None
        return sent


client = VertexUpstream  # the vertex kind's (core/upstream_kinds/vertex.py)
