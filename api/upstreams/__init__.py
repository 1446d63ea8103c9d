"""The upstreams of CEILING_UPSTREAMS (core/upstreams.py): one client per upstream and process,
each an implementation of the gateway's port (core/upstream.py Upstream) over api/upstream.py's
pooled client. A kind's record (core/upstream_kinds UpstreamKind.client) names the module here
whose `client(definition, timeout_s)` makes its clients (ClientFactory):

  openai     keyed.py   api.upstream.Upstream  any OpenAI-compatible API, a bearer key
  anthropic  keyed.py   api.upstream.Upstream  Anthropic's Messages API, `x-api-key`
  azure      azure.py   AzureUpstream    Azure OpenAI's v1 API (chat, Responses, embeddings)
  bedrock    bedrock.py BedrockUpstream  Claude on Amazon Bedrock (InvokeModel, its stream), SigV4
  vertex     vertex.py  VertexUpstream   Vertex AI: Gemini and Claude, a service account's token
  gemini     gemini.py  GeminiUpstream   Google's Gemini API, `x-goog-api-key`

A call's plan names the model it sends in its body's `model`, which the routing sets to
Routed.sent_model (an Azure deployment, a Bedrock model id); the clouds that name the model in
the path (Bedrock, Vertex's Claude) take it from there. A Gemini call's model is its route's
(Plan.model). Each module is imported with the first upstream of its kind, not with this one:
botocore and google-auth are a cold start's share that a gateway without such an upstream never
pays.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from api.runtime import runtime
from core.config import UPSTREAM_TIMEOUT_S_DEFAULT
from core.upstream import Upstream as UpstreamPort
from core.upstreams import UpstreamDef, kind_of

# What a client module's `client` is: the upstream's definition and its timeout -> its client.
ClientFactory = Callable[[UpstreamDef, float], UpstreamPort]

_clients: dict[str, UpstreamPort] = {}  # by upstream name


def client_of(definition: UpstreamDef, timeout_s: float) -> UpstreamPort:
    """This process's client of the upstream `definition` describes, made on first use."""
    found = _clients.get(definition.name)
    if found is None:
        found = _clients.setdefault(definition.name, made(definition, timeout_s))
    return found


def routed_client(definition: UpstreamDef) -> UpstreamPort:
    """The client of a named upstream a gateway call was routed to (core/gateway.py Gateway's
    `client_of`), awaited as long as any upstream call (CEILING_UPSTREAM_TIMEOUT_S)."""
    config = runtime().config
    return client_of(definition, UPSTREAM_TIMEOUT_S_DEFAULT if config is None
                     else config.upstream_timeout_s)


def factory(module: str) -> ClientFactory:
    """The `client` of api/upstreams/<module>.py, the module imported now if it was not."""
    return cast(ClientFactory, importlib.import_module(f"{__name__}.{module}").client)


def made(definition: UpstreamDef, timeout_s: float) -> UpstreamPort:
    """A new client of the upstream; ConfigError when its definition cannot make one."""
    return factory(kind_of(definition).client)(definition, timeout_s)
