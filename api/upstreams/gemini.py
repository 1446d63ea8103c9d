"""Google's Gemini API (https://ai.google.dev/api): `{base_url}/v1beta/models/{model}:
generateContent`, `:streamGenerateContent?alt=sse` and `:countTokens`, the key in
`x-goog-api-key`. base_url is Google's host, `https://generativelanguage.googleapis.com`, as the
google-genai SDK takes it (the API version is the path's).

The body goes as the gateway priced it, encoded anew (Plan.content): the client's fields, with
any bound the gateway added (a default maxOutputTokens, a clamp) and snake_case thinkingConfig
names in camelCase; answers, streams and errors are Google's, as the Gemini format reads them.
The model is sent by the name its upstream knows it by (Plan.model_sent). Vertex AI serves the same
API behind its own token (api/upstreams/vertex.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from api.upstreams.base import CloudUpstream
from core.config import ConfigError
from core.upstream import Headers, NotSent, Sent, Unanswered
from core.upstreams import UpstreamDef

if TYPE_CHECKING:
    import httpx

    from core.formats import Api, Plan

KEY_HEADER = "x-goog-api-key"
API_VERSION = "v1beta"  # the google-genai SDK's default, and the API's fullest


def gemini_action(stream: bool) -> str:
    """A Gemini call's method in its path: its stream as server-sent events, as the SDKs ask."""
    return "streamGenerateContent?alt=sse" if stream else "generateContent"


class GeminiUpstream(CloudUpstream):
    """A `gemini` upstream (core/upstreams.py): the Gemini API with a key."""

    def __init__(self, definition: UpstreamDef, timeout_s: float, **kwargs: Any) -> None:
        if definition.base_url is None or definition.api_key is None:
            raise ConfigError(f"upstream {definition.name!r}: a gemini upstream needs its "
                              "base_url and api_key_env")
        super().__init__(definition.base_url, (KEY_HEADER, definition.api_key), timeout_s,
                         **kwargs)
        self.name = definition.name
        self.models_url = f"{self.base_url}/{API_VERSION}/models"

    async def open(self, call_plan: Plan) -> httpx.Response:
        url = f"{self.models_url}/{call_plan.model_sent}:{gemini_action(call_plan.stream)}"
        return await self.post(self.prepared_at(url), call_plan.content(), call_plan.headers)

    async def count(self, api: Api, content: bytes, headers: Headers, model: str = "") -> Sent:
        """:countTokens for `model` (the path names it), free; Unanswered for any failure. It goes
        with this client's own headers (its key) and none of the caller's."""
        del api, headers
        try:
            response = await self.post(self.prepared_at(f"{self.models_url}/{model}:countTokens"),
                                       content, ())
        except NotSent as exc:  # a count holds no money: no failure is more than Unanswered
            raise Unanswered(str(exc)) from exc
        return (response.status_code, self.relayed(response),
                await self.error_body(response))


client = GeminiUpstream  # the gemini kind's (core/upstream_kinds/gemini.py)
