"""Azure OpenAI's v1 API (https://learn.microsoft.com/azure/ai-foundry/openai/api-version-lifecycle):
OpenAI's bodies at `https://<resource>.openai.azure.com/openai/v1`, the key in `api-key`.

The gateway's chat, Responses and embeddings routes go to `/chat/completions`, `/responses` and
`/embeddings` below the base URL, as they go to OpenAI (each format's path, core/formats Api):
api/upstream.py's client does all of it but the key's header. The body's `model` is the
deployment (Routed.sent_model), sent as it is; the call is priced as the model the upstream's
`deployments` says it deploys. Answers, errors and streams are OpenAI's (Azure adds
content-filter results, which the formats do not read), relayed with Azure's request ids and
region.
"""

from __future__ import annotations

from typing import Any

from api.upstreams.base import CloudUpstream
from core.config import ConfigError
from core.upstreams import UpstreamDef

KEY_HEADER = "api-key"  # Azure's, for a resource's key
# Azure's answer headers the client gets beside the common ones: its request ids and region.
AZURE_HEADERS_RELAYED = ("apim-request-id", "x-ms-")


class AzureUpstream(CloudUpstream):
    """An `azure` upstream (core/upstreams.py): OpenAI's routes, the key in `api-key`."""

    headers_relayed = AZURE_HEADERS_RELAYED

    def __init__(self, definition: UpstreamDef, timeout_s: float, **kwargs: Any) -> None:
        if definition.base_url is None or definition.api_key is None:
            raise ConfigError(f"upstream {definition.name!r}: an azure upstream needs its "
                              "base_url and api_key_env")
        super().__init__(definition.base_url, (KEY_HEADER, definition.api_key), timeout_s,
                         **kwargs)
        self.name = definition.name


client = AzureUpstream  # the azure kind's (core/upstream_kinds/azure.py)
