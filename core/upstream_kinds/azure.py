"""`azure`: Azure OpenAI's v1 API (api/upstreams/azure.py), its own prices table; a call names
a deployment, priced as the model the upstream's `deployments` says it deploys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from core.ledger import Upstream
from core.upstream_kinds.kind import UpstreamDef, UpstreamKind, name_mapping


def _deployments(where: str, entry: Mapping[str, object], env: Mapping[str, str],
                 definition: UpstreamDef) -> UpstreamDef:
    del env
    deployed = name_mapping(where, "deployments", entry.get("deployments"))
    return replace(definition, priced={**definition.priced, **deployed}) if deployed \
        else definition


KIND = UpstreamKind("azure", frozenset({"chat", "responses", "embeddings"}), "azure",
                    Upstream.AZURE, "azure", fields=frozenset({"deployments"}),
                    model_fields=("deployments",), read=_deployments)
