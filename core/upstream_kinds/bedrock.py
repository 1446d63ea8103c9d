"""`bedrock`: Claude on Amazon Bedrock (api/upstreams/bedrock.py), SigV4-signed with the
environment's AWS keys, priced by the 'aws' table. `model_ids` names each model's Bedrock id:
a call may name either, is priced as the model, and is sent as the id."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from core.ledger import Upstream
from core.prices import bedrock_price_key
from core.upstream_kinds.kind import UpstreamDef, UpstreamKind, UpstreamsError, name_mapping


def _model_ids(where: str, entry: Mapping[str, object], env: Mapping[str, str],
               definition: UpstreamDef) -> UpstreamDef:
    priced, sent = dict(definition.priced), {}
    for model, model_id in name_mapping(where, "model_ids", entry.get("model_ids")).items():
        priced[model] = priced[model_id] = model
        sent[model] = model_id
    key_id, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not key_id or not secret:
        raise UpstreamsError(f"{where}: a bedrock upstream signs with AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY, which are not both set")
    return replace(definition, priced=priced, sent=sent, signing_credentials=(
        key_id, secret, env.get("AWS_SESSION_TOKEN") or None))


def _where_it_runs(upstream: UpstreamDef, priced_model: str, sent_model: str) -> str:
    """The 'aws' table prices Claude by where the call runs, which the model id sent says
    (core/prices bedrock_price_key: a global profile at its rates, anything else at the
    regional ones)."""
    del upstream, priced_model
    return bedrock_price_key(sent_model)


KIND = UpstreamKind("bedrock", frozenset({"messages"}), "aws", Upstream.AWS, "bedrock",
                    fields=frozenset({"region", "model_ids"}), model_fields=("model_ids",),
                    keyed=False, base_url_optional=True, read=_model_ids,
                    price_key=_where_it_runs)
