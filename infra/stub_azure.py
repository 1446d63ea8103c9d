"""Azure OpenAI's v1 API on the stub provider: the witness for a gateway's Azure upstream.

  POST /openai/v1/chat/completions, /openai/v1/responses, /openai/v1/embeddings
  POST /openai/deployments/{deployment}/chat/completions, .../{deployment}/embeddings,
       /openai/responses                  the dated API, `?api-version=` required (any value)

(https://learn.microsoft.com/azure/ai-foundry/openai/api-version-lifecycle, "API evolution":
the v1 routes take OpenAI's bodies, so `OpenAI(base_url="https://<resource>.openai.azure.com/
openai/v1/")` works; an `api-version` query is accepted and changes nothing. The dated routes
are the ones the `openai` SDK's AzureOpenAI(azure_endpoint=...) calls: the deployment is the
path's, whatever the body's `model` says.) Each is the OpenAI
route's own API (infra.stub_chat, stub_responses, stub_embeddings): counted, decided, billed and
answered by it, with its faults and X-Stub-* headers, but:
- the key is the `api-key` header (or `Authorization: Bearer`), required: a call without one,
  or with another than the stub's --api-key when it has one, is refused 401, unbilled;
- the body's `model` is a deployment name, which the /control setting `deployments`
  {deployment: priced model} maps to the model it is billed (and answered) as; the bill logs
  the model as the priced one and the deployment as `model_requested`. An unknown deployment is
  refused 404 `DeploymentNotFound`, unbilled;
- errors are in Azure's shape, `{"error": {"code", "message", "param", "type"}}` (OpenAI's, with
  Azure's codes), and every answer carries `apim-request-id` and `x-ms-region`;
- a chat answer reports Azure's content filtering (`prompt_filter_results`, and each choice's
  `content_filter_results`: nothing filtered), and a chat stream opens, as Azure's does, with a
  chunk of no choices and an empty `model` that carries only `prompt_filter_results`.
The stored responses and prompt caches are the OpenAI routes' own (one resource's, as if Azure
and OpenAI shared them): a test that needs them apart uses two stubs.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from infra.stub_faults import REGISTRY_ENTRIES_MAX, Api, ApiError, Decided, Fault, sse

if TYPE_CHECKING:
    from infra.stub_prices import StubPrices
    from infra.stub_provider import StubProviderApp

CONTROL_FIELDS = frozenset({"deployments"})
API_PREFIX = "azure."
V1_PREFIX = "/openai/v1/"
# The region Azure names in `x-ms-region`: the stub's own.
REGION = "East US"
DEPLOYMENT_NOT_FOUND = (
    "The API deployment for this resource does not exist. If you created the deployment within "
    "the last 5 minutes, please wait a moment and try again.")
ACCESS_DENIED = ("Access denied due to invalid subscription key or wrong API endpoint. Make sure "
                 "to provide a valid key for an active subscription and use a correct regional "
                 "API endpoint for your resource.")

CHAT = "chat.completions"
# Azure's content filtering, reported on every chat answer: nothing filtered.
FILTER_RESULTS = {kind: {"filtered": False, "severity": "safe"}
                  for kind in ("hate", "self_harm", "sexual", "violence")}
PROMPT_FILTER_RESULTS = [{"prompt_index": 0, "content_filter_results": FILTER_RESULTS}]

D = TypeVar("D", bound=Decided)


def deployments_from(doc: object, prices: StubPrices) -> dict[str, str]:
    """/control's `deployments`: each deployment name to a model the table prices."""
    if not isinstance(doc, Mapping) or len(doc) > REGISTRY_ENTRIES_MAX:
        raise ValueError(f"deployments is an object of at most {REGISTRY_ENTRIES_MAX} "
                         "deployment names")
    for name, model in doc.items():
        if not isinstance(name, str) or not name or not isinstance(model, str):
            raise ValueError("deployments maps a deployment name to a model name")
        if prices.model(model) is None:
            raise ValueError(f"deployments[{name!r}]: the stub prices no model {model!r}")
    return dict(doc)


class Azure:
    """Azure's routes, each on the OpenAI route it wraps, and their deployments."""

    def __init__(self, app: StubProviderApp) -> None:
        self.app = app
        self.deployments: dict[str, str] = {}
        self.chat = AzureApi(self, app.chat)
        self.responses = AzureApi(self, app.responses)
        self.embeddings = AzureApi(self, app.embeddings)

    def routes(self) -> list[Route]:
        return [Route(path, endpoint, methods=["POST"]) for path, endpoint in (
            ("/openai/v1/chat/completions", self.chat.serve),
            ("/openai/v1/responses", self.responses.serve),
            ("/openai/v1/embeddings", self.embeddings.serve),
            ("/openai/deployments/{deployment}/chat/completions", self.chat.serve),
            ("/openai/deployments/{deployment}/embeddings", self.embeddings.serve),
            ("/openai/responses", self.responses.serve))]


class AzureApi(Api[D], Generic[D]):
    """An OpenAI route as Azure serves it: Azure's key, deployments and error codes."""

    def __init__(self, azure: Azure, inner: Api[D]) -> None:
        self.azure = azure
        self.inner = inner
        self.name = API_PREFIX + inner.name
        self.request_bytes_max = inner.request_bytes_max
        self.stream_media_type = inner.stream_media_type

    async def serve(self, request: Request) -> Response:
        return await self.azure.app.serve(self, request)

    def headers(self) -> dict[str, str]:
        return {**self.inner.headers(), "apim-request-id": str(uuid.uuid4()),
                "x-ms-region": REGION}

    def error(self, error: ApiError, headers: dict[str, str]) -> Response:
        response = self.inner.error(error, headers)
        response.headers.update({k: v for k, v in headers.items() if k not in response.headers})
        return response

    def check(self, request: Request) -> set[str]:
        given = request.headers.get("api-key")
        bearer = request.headers.get("authorization", "")
        if given is None and bearer.startswith("Bearer "):
            given = bearer.removeprefix("Bearer ")
        key = self.azure.app.api_key
        if not given or (key is not None and given != key):
            raise ApiError(401, ACCESS_DENIED, "401", "invalid_request_error")
        if (not request.url.path.startswith(V1_PREFIX)
                and "api-version" not in request.query_params):
            raise ApiError(404, "Resource not found", "404", "invalid_request_error")
        return set()

    def model_of(self, body: dict[str, Any], request: Request) -> str | None:
        """The deployment: the dated routes' path, else the body's `model`."""
        deployment = request.path_params.get("deployment", body.get("model"))
        return deployment if isinstance(deployment, str) else None

    def decide(self, body: dict[str, Any], request: Request, fault: Fault,
               betas: set[str]) -> D:
        deployment = self.model_of(body, request)
        if deployment is None:
            raise ApiError(400, "model (the deployment name) is required", param="model")
        model = self.azure.deployments.get(deployment)
        if model is None:
            raise ApiError(404, DEPLOYMENT_NOT_FOUND, "DeploymentNotFound",
                           "invalid_request_error")
        decided = self.inner.decide({**body, "model": model}, request, fault, betas)
        return replace(decided, model_requested=deployment)

    def charged(self, decided: D, fault: Fault) -> None:
        self.inner.charged(decided, fault)

    def body(self, decided: D) -> dict[str, Any]:
        doc = self.inner.body(decided)
        if self.inner.name == CHAT:
            doc["prompt_filter_results"] = PROMPT_FILTER_RESULTS
            for choice in doc["choices"]:
                choice["content_filter_results"] = FILTER_RESULTS
        return doc

    def events(self, decided: D, fault: Fault) -> list[bytes]:
        events = self.inner.events(decided, fault)
        if self.inner.name == CHAT:
            # Azure opens a chat stream with a chunk of no choices and no model, which only
            # reports the prompt's filtering: a parser that reads choices[0] of every chunk
            # fails on it.
            events = [sse({"choices": [], "created": 0, "id": "", "model": "", "object": "",
                           "prompt_filter_results": PROMPT_FILTER_RESULTS}), *events]
        return events

    def failed_events(self, decided: D, failure: ApiError) -> list[bytes] | None:
        return self.inner.failed_events(decided, failure)
