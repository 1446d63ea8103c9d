"""The kinds of upstream CEILING_UPSTREAMS may name (core/upstreams.py), one module each with its
record (core/upstream_kinds/kind.py UpstreamKind): the routes it serves, the prices table and
bill its calls are on, the fields it takes and how it reads them, and the api/upstreams module
that makes its client. Adding a kind is its module here, its client's module in api/upstreams
(or an existing one's name), and its entry below: docs/gateway.md, "Adding a provider API".
"""

from __future__ import annotations

from collections.abc import Mapping

from core.upstream_kinds import anthropic, azure, bedrock, gemini, openai, vertex
from core.upstream_kinds.kind import UpstreamKind

# In the order the file's `api` is offered in its error message.
KINDS: Mapping[str, UpstreamKind] = {kind.name: kind for kind in (
    openai.KIND, anthropic.KIND, gemini.KIND, vertex.KIND, bedrock.KIND, azure.KIND)}
