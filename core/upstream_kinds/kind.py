"""What one kind of upstream is (CEILING_UPSTREAMS' `api`): UpstreamKind, the record each kind
declares in its own module of this package, and the definition (UpstreamDef) the gateway routes,
prices and bills a named upstream by. core/upstreams.py reads a file of upstreams through these
records and names no kind itself; api/upstreams/<UpstreamKind.client>.py makes a kind's client.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from core.errors import InvalidRequest
from core.ledger import Upstream

# Model names as providers spell them (OpenRouter's carry a slash, Bedrock's a colon).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}")
# The settings a kind may take beyond the common fields that core/upstreams.py reads for it,
# each required once the kind names it in its `fields`: where its endpoint runs and whose it is.
PLACE_FIELDS = ("region", "project")


class UpstreamsError(InvalidRequest):
    """CEILING_UPSTREAMS does not describe upstreams the gateway can route to; the message says
    what to fix."""

    code = "invalid_configuration"


@dataclass(frozen=True)
class UpstreamDef:
    name: str
    api: str  # its kind's name (UpstreamKind.name), as the file spells it
    base_url: str | None
    prices_provider: str
    # What a call names -> what is priced: a model is priced by its own name, an Azure deployment
    # by the model it deploys, a Bedrock model id by the model it is.
    priced: Mapping[str, str]
    # What a call names -> what is sent upstream: a Bedrock model's priced name -> its id.
    sent: Mapping[str, str] = field(default_factory=dict)
    # What a call names -> the name `prices_provider`'s table prices it by, where that is not
    # the priced name (UpstreamKind.price_key): made once at load, so a call only looks it up.
    price_keys: Mapping[str, str] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)
    region: str | None = None
    project: str | None = None
    credentials_file: str | None = None
    # A kind that signs its requests: the key it signs with, from the environment (Bedrock's:
    # access key id, secret access key, session token or None).
    signing_credentials: tuple[str, str, str | None] | None = field(default=None, repr=False)


# A kind's reading of its own fields (`entry`, the file's object) into the definition the common
# fields made, from the environment `env`; UpstreamsError naming `where` for what is wrong.
Read = Callable[[str, Mapping[str, object], Mapping[str, str], UpstreamDef], UpstreamDef]
# The name a model is priced by in the upstream's table: (upstream, priced name, sent name).
PriceKey = Callable[[UpstreamDef, str, str], str]
# The one route of a kind's that serves a model (by its sent name), for a kind whose routes
# serve different models; None: any of its routes.
RouteOf = Callable[[str], str | None]


def _as_declared(where: str, entry: Mapping[str, object], env: Mapping[str, str],
                 definition: UpstreamDef) -> UpstreamDef:
    del where, entry, env
    return definition


def _priced_as_named(upstream: UpstreamDef, priced_model: str, sent_model: str) -> str:
    del upstream, sent_model
    return priced_model


def _any_route(sent_model: str) -> str | None:
    del sent_model
    return None


@dataclass(frozen=True)
class UpstreamKind:
    """One kind of upstream: everything reading, routing, pricing and billing one takes, in one
    record its module declares (core/upstream_kinds/<name>.py) and core/upstream_kinds KINDS
    registers. Its client is made by api/upstreams/<client>.py's `client` (the api layer's half,
    which core does not import)."""

    name: str  # CEILING_UPSTREAMS' `api` for it
    # The gateway routes it serves: its formats' WireFormat.routed_as.
    routes: frozenset[str]
    # The genai-prices provider it is priced by when the file gives no `prices_provider`.
    prices_provider: str
    # Whose bill its calls are on, the day counter reconciliation reads (core/ledger.py).
    bill: Upstream
    # The module of api/upstreams whose `client(definition, timeout_s)` makes its client.
    client: str
    # With `bill_own_prices_only`, its calls are on `bill` only when priced by its own table
    # (`prices_provider`); priced by any other, they are another provider's bill
    # (Upstream.OTHER), which its report lacks: an OpenAI-compatible router's.
    bill_own_prices_only: bool = False
    # With `bill_host`, its calls are on `bill` only when its base URL's host is that one (the
    # provider's own API); at any other host (a router, a proxy, a local server speaking the
    # same API) they are Upstream.OTHER: counted on the provider's bill, their spend would hide
    # spend made with the provider's own keys from what reconcile books (bill_at).
    bill_host: str | None = None
    # The fields it takes beyond the common ones; any other is refused, so that a misspelt
    # setting is not silently ignored. Those of PLACE_FIELDS it names are required.
    fields: frozenset[str] = frozenset()
    # Its fields that name models besides `models`, for the message of one that names none.
    model_fields: tuple[str, ...] = ()
    # Whether it authenticates with a key from the environment (api_key_env, optional: a local
    # server may take none); if not, it authenticates otherwise and refuses api_key_env. Where
    # the key goes is its client's.
    keyed: bool = True
    # Whether it has a default endpoint (derived from its region or project).
    base_url_optional: bool = False
    read: Read = _as_declared
    price_key: PriceKey = _priced_as_named
    route_of: RouteOf = _any_route


@functools.lru_cache(maxsize=64)
def bill_at(bill: Upstream, bill_host: str | None, base_url: str | None) -> Upstream:
    """The bill of calls sent to `base_url` by a kind (or a one-upstream shorthand's provider)
    whose calls are on `bill` at `bill_host`: `bill` where the host is that one (or none is
    required, or no URL is set: the client's default is the provider's own), else OTHER."""
    if bill_host is None or base_url is None:
        return bill
    return bill if urlsplit(base_url).hostname == bill_host else Upstream.OTHER


def names(where: str, key: str, value: object) -> list[str]:
    """`value`, the file's `key`: a list of model names; UpstreamsError if it is not."""
    if not isinstance(value, list) or not all(
            isinstance(m, str) and MODEL_NAME.fullmatch(m) for m in value):
        raise UpstreamsError(f"{where}: `{key}` is a list of model names")
    return value


def name_mapping(where: str, key: str, value: object) -> dict[str, str]:
    """`value`, the file's `key`: names mapped to model names ({} when absent)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and MODEL_NAME.fullmatch(k)
            and MODEL_NAME.fullmatch(v) for k, v in value.items()):
        raise UpstreamsError(f"{where}: `{key}` maps names to model names")
    return value


def text(where: str, key: str, value: object, *, required: bool) -> str | None:
    """`value`, the file's `key`: a non-empty string (None when absent and not required)."""
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise UpstreamsError(f"{where}: `{key}` is required")
    return value
