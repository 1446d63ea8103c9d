"""`bedrock`: Claude on Amazon Bedrock (api/upstreams/bedrock.py), SigV4-signed with the
environment's AWS keys, priced by the 'aws' table. `model_ids` names each model's Bedrock id:
a call may name either, is priced as the model, and is sent as the id. A Claude id listed in
`models` is the model `model_ids` would name it by (bedrock_model_name), so that a budget's
per_model limit and allow-list count it as the model."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

from core.ledger import Upstream
from core.prices import bedrock_price_key
from core.prices.bundled import BEDROCK_GEO_PREFIXES
from core.upstream_kinds.kind import UpstreamDef, UpstreamKind, UpstreamsError, name_mapping

# A Bedrock model id's version suffix (`-v1:0`), which Anthropic's names of the model lack.
_VERSION_SUFFIX = re.compile(r"-v\d+(?::\d+)?$")


def bedrock_model_name(model_id: str) -> str | None:
    """The Anthropic name of the Claude a Bedrock id calls (`us.anthropic.claude-haiku-4-5-
    20251001-v1:0` is `claude-haiku-4-5-20251001`: no geographic or `global.` profile, no vendor,
    no version), which PriceTable.model_name gives its one name; None for an id that is not
    Claude's, or not in that shape."""
    name = model_id.rsplit("/", 1)[-1] if model_id.startswith("arn:") else model_id
    prefix, _, rest = name.partition(".")
    if prefix in BEDROCK_GEO_PREFIXES or prefix == "global":
        name = rest
    if not name.startswith("anthropic."):
        return None
    base = _VERSION_SUFFIX.sub("", name.removeprefix("anthropic."))
    return base if base and "." not in base and ":" not in base else None


def _model_ids(where: str, entry: Mapping[str, object], env: Mapping[str, str],
               definition: UpstreamDef) -> UpstreamDef:
    # An id in `models` is priced (and counted) as its model; it is sent as it is.
    priced = {named: bedrock_model_name(named) or model
              for named, model in definition.priced.items()}
    sent: dict[str, str] = {}
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
