"""Anthropic's `anthropic-beta` flags as a cloud takes them (Bedrock, Vertex AI).

The clouds serve Claude with fewer betas than Anthropic, some under names of their own, and fail
a call that names one they do not take (Bedrock: 400 "invalid beta flag"; Vertex: 400
"Unexpected value(s) ... for the anthropic-beta header"). Claude Code sends Anthropic's set,
and when it is pointed at the gateway as at Anthropic it does not trim them for a cloud as its
own Bedrock and Vertex modes do; so the cloud's client does: it sends the cloud's name of each
beta the cloud takes (CLOUD_NAMES) and leaves the others out.

Leaving one out costs nothing the hold does not cover: every beta a call reaches a cloud with
passed the Messages format's check (core/formats/messages.py MESSAGES_BETAS, or the operator's
CEILING_GATEWAY_BETAS_ALLOWED), which lets through only betas that bill nothing beyond what the
body is held at, and the one that changes rates (the 1M context) is priced and which both clouds
take. A feature a left-out beta opens is then refused by the cloud, unbilled, which releases the
hold.
"""

from __future__ import annotations

from collections.abc import Mapping

from core.upstream import Headers

BETA_HEADER = "anthropic-beta"
# Anthropic's betas that a cloud names otherwise: advanced tool use is the clouds' tool search
# and tool examples betas (Anthropic's tool search page, "on Amazon Bedrock and Google Cloud's
# Vertex AI").
CLOUD_NAMES: Mapping[str, tuple[str, ...]] = {
    "advanced-tool-use-2025-11-20": ("tool-search-tool-2025-10-19", "tool-examples-2025-10-29"),
}
# The betas each cloud takes for Claude: Bedrock's request-and-response page's list, Vertex's
# Claude page and the feature pages' notes on it; both take Claude Code's identification.
BEDROCK_BETAS = frozenset({
    "computer-use-2024-10-22", "computer-use-2025-01-24", "token-efficient-tools-2025-02-19",
    "interleaved-thinking-2025-05-14", "output-128k-2025-02-19", "dev-full-thinking-2025-05-14",
    "context-1m-2025-08-07", "context-management-2025-06-27", "effort-2025-11-24",
    "tool-search-tool-2025-10-19", "tool-examples-2025-10-29", "claude-code-20250219",
})
VERTEX_BETAS = BEDROCK_BETAS - {"dev-full-thinking-2025-05-14"}


def betas_taken(betas: list[str], taken: frozenset[str]) -> list[str]:
    """`betas` as a cloud that takes `taken` names them, in order, each once; the others left
    out (the module docstring says why that is safe)."""
    named = [cloud for beta in betas for cloud in CLOUD_NAMES.get(beta, (beta,))]
    return [beta for beta in dict.fromkeys(named) if beta in taken]


def headers_for(headers: Headers, taken: frozenset[str]) -> Headers:
    """The client's forwarded headers with `anthropic-beta` holding the betas a cloud that
    takes `taken` serves (betas_taken), and no such header when none is left."""
    betas = [beta.strip() for name, value in headers if name.lower() == BETA_HEADER
             for beta in value.split(",") if beta.strip()]
    kept = tuple((name, value) for name, value in headers if name.lower() != BETA_HEADER)
    served = betas_taken(betas, taken)
    return (*kept, (BETA_HEADER, ",".join(served))) if served else kept
