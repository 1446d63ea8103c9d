"""Named upstreams (CEILING_UPSTREAMS): where a model's calls go, and whose prices they are held at.

The file names each upstream's API kind, base URL, credentials, the models it serves and the
genai-prices provider its calls are priced by. A model resolves to exactly one upstream: by its
exact name in one upstream's models (an Azure deployment's name, a Bedrock model's priced name
or its Bedrock id), or as `<upstream name>/<model>`. A model no upstream names is refused and
forwarded nowhere; a name two upstreams serve is refused until the caller says which, so that a
call is never priced by one provider's table and billed by another's.

The one-upstream settings (CEILING_UPSTREAM_URL, CEILING_ANTHROPIC_URL) stay a shorthand for a
gateway that reaches one OpenAI-compatible provider and Anthropic; they are not upstreams here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from core.errors import InvalidRequest
from core.ledger import Upstream
from core.prices import bedrock_price_key

# An operator's file, read once at startup: a bound on what a mistyped path can make us parse.
UPSTREAMS_FILE_BYTES_MAX = 1_000_000
# Names go into error messages and `<name>/<model>`; a slash would make the second ambiguous.
UPSTREAM_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
# Model names as providers spell them (OpenRouter's carry a slash, Bedrock's a colon).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}")


class UpstreamsError(InvalidRequest):
    """CEILING_UPSTREAMS does not describe upstreams the gateway can route to; the message says
    what to fix."""

    code = "invalid_configuration"


class ModelNotRouted(InvalidRequest):
    """No upstream serves the model on this route: nothing was held or forwarded."""

    code = "model_not_routed"


class UpstreamApi(StrEnum):
    OPENAI = "openai"  # OpenAI and any OpenAI-compatible provider (OpenRouter, Groq, vLLM)
    ANTHROPIC = "anthropic"
    GEMINI = "gemini"
    VERTEX = "vertex"
    BEDROCK = "bedrock"
    AZURE = "azure"


# The gateway routes (their wire formats' names, core/formats) each kind of upstream serves.
ROUTES_SERVED: Mapping[UpstreamApi, frozenset[str]] = {
    UpstreamApi.OPENAI: frozenset({"chat", "responses", "embeddings"}),
    UpstreamApi.AZURE: frozenset({"chat", "responses", "embeddings"}),
    UpstreamApi.ANTHROPIC: frozenset({"messages"}),
    UpstreamApi.BEDROCK: frozenset({"messages"}),
    UpstreamApi.VERTEX: frozenset({"messages", "gemini"}),
    UpstreamApi.GEMINI: frozenset({"gemini"}),
}
# The genai-prices provider a kind of upstream is priced by when `prices_provider` is not given.
# Azure and Bedrock have tables of their own; Vertex's Gemini prices are Google's.
PRICES_PROVIDER_DEFAULT: Mapping[UpstreamApi, str] = {
    UpstreamApi.OPENAI: "openai",
    UpstreamApi.AZURE: "azure",
    UpstreamApi.ANTHROPIC: "anthropic",
    UpstreamApi.BEDROCK: "aws",
    UpstreamApi.VERTEX: "google",
    UpstreamApi.GEMINI: "google",
}
# Whose bill a kind of upstream's calls are on, the day counter reconciliation reads
# (core/ledger.py Upstream). An OpenAI-compatible upstream priced by OpenAI's table is taken to
# be OpenAI; priced by any other, it is another provider's bill, which OpenAI's report lacks.
BILLS: Mapping[UpstreamApi, Upstream] = {
    UpstreamApi.ANTHROPIC: Upstream.ANTHROPIC,
    UpstreamApi.BEDROCK: Upstream.AWS,
    UpstreamApi.AZURE: Upstream.AZURE,
    UpstreamApi.VERTEX: Upstream.GOOGLE,
    UpstreamApi.GEMINI: Upstream.GOOGLE,
}


def bill_of(upstream: UpstreamDef) -> Upstream:
    """The bill a call to `upstream` is on (BILLS)."""
    if upstream.api is UpstreamApi.OPENAI:
        return Upstream.OPENAI if upstream.prices_provider == "openai" else Upstream.OTHER
    return BILLS[upstream.api]


# The fields each kind takes beyond the common ones; any other field is refused, so that a
# misspelt setting is not silently ignored.
COMMON_FIELDS = frozenset({"name", "api", "base_url", "api_key_env", "models", "prices_provider"})
KIND_FIELDS: Mapping[UpstreamApi, frozenset[str]] = {
    UpstreamApi.OPENAI: frozenset(),
    UpstreamApi.ANTHROPIC: frozenset(),
    UpstreamApi.GEMINI: frozenset(),
    UpstreamApi.AZURE: frozenset({"deployments"}),
    UpstreamApi.BEDROCK: frozenset({"region", "model_ids"}),
    UpstreamApi.VERTEX: frozenset({"project", "region", "credentials_file"}),
}
# Vertex's location that serves a model from any region, at the model's base price; and the
# prefix of the name regional Vertex Claude is priced by (price_key).
VERTEX_GLOBAL_REGION = "global"
VERTEX_REGIONAL_PREFIX = "regional."
CLAUDE_PREFIX = "claude-"
# Kinds with a default endpoint (derived from region/project); the others need base_url.
BASE_URL_OPTIONAL = frozenset({UpstreamApi.BEDROCK, UpstreamApi.VERTEX})
# Kinds that authenticate with an API key from the environment.
KEYED = frozenset({UpstreamApi.OPENAI, UpstreamApi.AZURE, UpstreamApi.ANTHROPIC,
                   UpstreamApi.GEMINI})


@dataclass(frozen=True)
class UpstreamDef:
    name: str
    api: UpstreamApi
    base_url: str | None
    prices_provider: str
    # What a call names -> what is priced: a model is priced by its own name, an Azure deployment
    # by the model it deploys, a Bedrock model id by the model it is.
    priced: Mapping[str, str]
    # What a call names -> what is sent upstream: a Bedrock model's priced name -> its id.
    sent: Mapping[str, str] = field(default_factory=dict)
    # A priced name -> the name `prices_provider`'s table prices it by, where they differ
    # (price_key): made once at load, so a call only looks it up.
    price_keys: Mapping[str, str] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)
    region: str | None = None
    project: str | None = None
    credentials_file: str | None = None
    # Bedrock's: (access key id, secret access key, session token or None).
    aws_credentials: tuple[str, str, str | None] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Routed:
    """Where one call goes: its upstream, the model it is priced as and the name sent."""

    upstream: UpstreamDef
    priced_model: str
    sent_model: str
    # The name the call is held, settled and recorded in the ledger by, in the upstream's
    # prices table: the priced model's, but for Bedrock's and regional Vertex Claude (price_key).
    price_model: str = ""


@dataclass(frozen=True)
class Upstreams:
    by_name: Mapping[str, UpstreamDef]
    # A model's exact name -> the upstreams that serve it (two or more: it needs a prefix).
    by_model: Mapping[str, tuple[str, ...]]

    def resolve(self, model: str, route: str) -> Routed:
        """The upstream that serves `model` on `route` (a wire format's name); ModelNotRouted
        when none does, or when two do and the call did not say which."""
        names = self.by_model.get(model, ())
        if len(names) == 1:
            return self._routed(self.by_name[names[0]], model, route)
        if len(names) > 1:
            raise ModelNotRouted(
                f"model {model!r} is served by upstreams {', '.join(names)}: name one as "
                f"{' or '.join(f'{n}/{model}' for n in names)}")
        prefix, _, rest = model.partition("/")
        upstream = self.by_name.get(prefix)
        if upstream is not None and rest in upstream.priced:
            return self._routed(upstream, rest, route)
        raise ModelNotRouted(
            f"no upstream in CEILING_UPSTREAMS serves model {model!r}: nothing was held or "
            "forwarded. Add it to an upstream's `models` to call it")

    @staticmethod
    def _routed(upstream: UpstreamDef, model: str, route: str) -> Routed:
        if route not in ROUTES_SERVED[upstream.api]:
            raise ModelNotRouted(
                f"model {model!r} is served by upstream {upstream.name!r}, a {upstream.api} "
                f"upstream, which serves the {', '.join(sorted(ROUTES_SERVED[upstream.api]))} "
                f"route(s), not {route}: nothing was held or forwarded")
        priced = upstream.priced[model]
        return Routed(upstream, priced, upstream.sent.get(model, model),
                      upstream.price_keys.get(priced, priced))


def price_key(upstream: UpstreamDef, priced_model: str, sent_model: str) -> str:
    """The name a model is priced by in the upstream's table, where it is not its priced name.

    Bedrock: the 'aws' table prices Claude by where the call runs, which the model id sent says
    (core/prices bedrock_price_key: a global profile at its rates, anything else at the regional
    ones). Vertex: Claude by the dated name the tables use (`@` as `-`). At a regional
    endpoint (any `region` but `global`) Claude costs 10% more than at the global one from
    Claude 4.5 on, and Google's table has only the global rates: so there it is priced as
    `regional.<model>`, a name no bundled table has, and refused (model_unpriced, nothing held)
    until the prices file names it at what the region bills. Refused rather than held at a
    guessed premium: which models carry it is Anthropic's to change, and a wrong guess
    under-holds silently."""
    if upstream.api is UpstreamApi.BEDROCK:
        return bedrock_price_key(sent_model)
    if upstream.api is UpstreamApi.VERTEX and priced_model.startswith(CLAUDE_PREFIX):
        # Vertex dates Claude with `@` (claude-sonnet-4-5@20250929); the tables, with `-`.
        dated = priced_model.replace("@", "-")
        regional = upstream.region != VERTEX_GLOBAL_REGION
        return VERTEX_REGIONAL_PREFIX + dated if regional else dated
    return priced_model


def load(path: str, env: Mapping[str, str]) -> Upstreams:
    """The upstreams of the file at `path`; UpstreamsError naming the first thing to fix."""
    file = Path(path)
    try:
        if file.stat().st_size > UPSTREAMS_FILE_BYTES_MAX:
            raise UpstreamsError(f"CEILING_UPSTREAMS: {path} is larger than "
                                 f"{UPSTREAMS_FILE_BYTES_MAX} bytes")
        doc = json.loads(file.read_bytes())
    except OSError as exc:
        raise UpstreamsError(f"CEILING_UPSTREAMS: cannot read {path} ({exc.strerror})") from exc
    except ValueError as exc:
        raise UpstreamsError(f"CEILING_UPSTREAMS: {path} is not JSON ({exc})") from exc
    return parse(doc, env)


def parse(doc: object, env: Mapping[str, str]) -> Upstreams:
    if not isinstance(doc, dict) or set(doc) != {"upstreams"} or not isinstance(
            doc["upstreams"], list) or not doc["upstreams"]:
        raise UpstreamsError('CEILING_UPSTREAMS: the file is {"upstreams": [...]}, a non-empty '
                             "list of upstreams")
    by_name: dict[str, UpstreamDef] = {}
    by_model: dict[str, list[str]] = {}
    for index, entry in enumerate(doc["upstreams"]):
        upstream = _upstream(index, entry, env)
        if upstream.name in by_name:
            raise UpstreamsError(f"CEILING_UPSTREAMS: two upstreams are named {upstream.name!r}")
        by_name[upstream.name] = upstream
        for model in upstream.priced:
            by_model.setdefault(model, []).append(upstream.name)
    return Upstreams(by_name, {m: tuple(ns) for m, ns in by_model.items()})


def _upstream(index: int, entry: object, env: Mapping[str, str]) -> UpstreamDef:
    where = f"CEILING_UPSTREAMS: upstream {index}"
    if not isinstance(entry, dict):
        raise UpstreamsError(f"{where} is not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not UPSTREAM_NAME.fullmatch(name):
        raise UpstreamsError(f"{where}: `name` must match {UPSTREAM_NAME.pattern}")
    where = f"CEILING_UPSTREAMS: upstream {name!r}"
    try:
        api = UpstreamApi(str(entry.get("api")))
    except ValueError:
        raise UpstreamsError(f"{where}: `api` must be one of "
                             f"{', '.join(a.value for a in UpstreamApi)}") from None
    unknown = set(entry) - COMMON_FIELDS - KIND_FIELDS[api]
    if unknown:
        raise UpstreamsError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} for a "
                             f"{api} upstream")
    base_url = _base_url(where, entry.get("base_url"), api)
    prices_provider = entry.get("prices_provider", PRICES_PROVIDER_DEFAULT[api])
    if not isinstance(prices_provider, str) or not prices_provider:
        raise UpstreamsError(f"{where}: `prices_provider` is a genai-prices provider id, such "
                             f"as {PRICES_PROVIDER_DEFAULT[api]!r}")
    priced = {m: m for m in _names(where, "models", entry.get("models", []))}
    sent: dict[str, str] = {}
    if api is UpstreamApi.AZURE:
        for deployment, model in _mapping(where, "deployments", entry.get("deployments")).items():
            priced[deployment] = model
    if api is UpstreamApi.BEDROCK:
        for model, model_id in _mapping(where, "model_ids", entry.get("model_ids")).items():
            priced[model] = priced[model_id] = model
            sent[model] = model_id
    if not priced:
        raise UpstreamsError(f"{where} serves no model: list them in `models`"
                             + {UpstreamApi.AZURE: " or `deployments`",
                                UpstreamApi.BEDROCK: " or `model_ids`"}.get(api, ""))
    definition = UpstreamDef(
        name=name, api=api, base_url=base_url, prices_provider=prices_provider, priced=priced,
        sent=sent, api_key=_api_key(where, entry.get("api_key_env"), api, env),
        region=_text(where, "region", entry.get("region"), required=api is UpstreamApi.BEDROCK
                     or api is UpstreamApi.VERTEX),
        project=_text(where, "project", entry.get("project"),
                      required=api is UpstreamApi.VERTEX),
        credentials_file=_credentials_file(where, entry.get("credentials_file"), api),
        aws_credentials=_aws_credentials(where, env) if api is UpstreamApi.BEDROCK else None,
    )
    keys = {model: key for model in set(priced.values())
            if (key := price_key(definition, model, sent.get(model, model))) != model}
    return replace(definition, price_keys=keys) if keys else definition


def _aws_credentials(where: str, env: Mapping[str, str]) -> tuple[str, str, str | None]:
    key_id, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not key_id or not secret:
        raise UpstreamsError(f"{where}: a bedrock upstream signs with AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY, which are not both set")
    return key_id, secret, env.get("AWS_SESSION_TOKEN") or None


def _base_url(where: str, value: object, api: UpstreamApi) -> str | None:
    if value is None and api in BASE_URL_OPTIONAL:
        return None
    if not isinstance(value, str) or not value.startswith(("https://", "http://")):
        raise UpstreamsError(f"{where}: `base_url` must be an http(s) URL")
    return value.rstrip("/")


def _names(where: str, key: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(
            isinstance(m, str) and MODEL_NAME.fullmatch(m) for m in value):
        raise UpstreamsError(f"{where}: `{key}` is a list of model names")
    return value


def _mapping(where: str, key: str, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and MODEL_NAME.fullmatch(k)
            and MODEL_NAME.fullmatch(v) for k, v in value.items()):
        raise UpstreamsError(f"{where}: `{key}` maps names to model names")
    return value


def _text(where: str, key: str, value: object, *, required: bool) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise UpstreamsError(f"{where}: `{key}` is required")
    return value


def _api_key(where: str, env_name: object, api: UpstreamApi,
             env: Mapping[str, str]) -> str | None:
    if api not in KEYED:
        if env_name is not None:
            raise UpstreamsError(f"{where}: a {api} upstream authenticates without "
                                 "`api_key_env`")
        return None
    if env_name is None:
        return None  # a local OpenAI-compatible server may take no key
    if not isinstance(env_name, str) or not env.get(env_name):
        raise UpstreamsError(f"{where}: `api_key_env` names {env_name!r}, which is not set")
    return env[env_name]


def _credentials_file(where: str, value: object, api: UpstreamApi) -> str | None:
    if api is not UpstreamApi.VERTEX:
        return None
    if not isinstance(value, str) or not Path(value).is_file():
        raise UpstreamsError(f"{where}: `credentials_file` must name a service-account JSON "
                             "file that exists")
    return value
