"""Named upstreams (CEILING_UPSTREAMS): where a model's calls go, and whose prices they are held at.

The file names each upstream's API kind, base URL, credentials, the models it serves and the
genai-prices provider its calls are priced by. A model resolves to exactly one upstream: by its
exact name in one upstream's models (an Azure deployment's name, a Bedrock model's priced name
or its Bedrock id), or as `<upstream name>/<model>`. A model no upstream names is refused and
forwarded nowhere; a name two upstreams serve is refused until the caller says which, so that a
call is never priced by one provider's table and billed by another's. A file in which one name is
both an exact name and `<name>/<model>` (a router's `anthropic/claude-sonnet-4-5` beside an
upstream `anthropic` that serves `claude-sonnet-4-5`) is refused when it is read.

What differs between kinds (the file's `api`: the routes each serves, its prices table and bill,
the fields it takes and how it reads them, the name a model is priced by) is each kind's record,
core/upstream_kinds; nothing here names a kind.

The one-upstream settings (CEILING_UPSTREAM_URL, CEILING_ANTHROPIC_URL) stay a shorthand for a
gateway that reaches one OpenAI-compatible provider and Anthropic; they are not upstreams here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from core.errors import InvalidRequest
from core.ledger import Upstream
from core.upstream_kinds import KINDS
from core.upstream_kinds.kind import PLACE_FIELDS, UpstreamKind, bill_at, names, text
from core.upstream_kinds.kind import UpstreamDef as UpstreamDef
from core.upstream_kinds.kind import UpstreamsError as UpstreamsError

# An operator's file, read once at startup: a bound on what a mistyped path can make us parse.
UPSTREAMS_FILE_BYTES_MAX = 1_000_000
# Names go into error messages and `<name>/<model>`; a slash would make the second ambiguous.
UPSTREAM_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
# The fields every kind takes (UpstreamKind.fields: those of one kind).
COMMON_FIELDS = frozenset({"name", "api", "base_url", "api_key_env", "models", "prices_provider"})


class ModelNotRouted(InvalidRequest):
    """No upstream serves the model on this route: nothing was held or forwarded."""

    code = "model_not_routed"


def kind_of(upstream: UpstreamDef) -> UpstreamKind:
    """The record of the upstream's kind (core/upstream_kinds)."""
    return KINDS[upstream.api]


def bill_of(upstream: UpstreamDef) -> Upstream:
    """The bill a call to `upstream` is on (UpstreamKind.bill)."""
    kind = kind_of(upstream)
    if kind.bill_own_prices_only and upstream.prices_provider != kind.prices_provider:
        return Upstream.OTHER
    return bill_at(kind.bill, kind.bill_host, upstream.base_url)


@dataclass(frozen=True)
class Routed:
    """Where one call goes: its upstream, the model it is priced as and the name sent."""

    upstream: UpstreamDef
    priced_model: str
    sent_model: str
    # The name the call is held, settled and recorded in the ledger by, in the upstream's
    # prices table: the priced model's, but where its kind prices it by another name (Bedrock's
    # by where it runs, regional Vertex Claude's: UpstreamKind.price_key).
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
        served = kind_of(upstream).routes
        if route not in served:
            raise ModelNotRouted(
                f"model {model!r} is served by upstream {upstream.name!r}, a {upstream.api} "
                f"upstream, which serves the {', '.join(sorted(served))} "
                f"route(s), not {route}: nothing was held or forwarded")
        served_on = kind_of(upstream).route_of(upstream.sent.get(model, model))
        if served_on not in (None, route):
            raise ModelNotRouted(
                f"model {model!r} is served by upstream {upstream.name!r}, a {upstream.api} "
                f"upstream, on the {served_on} route, not {route}: nothing was held or "
                "forwarded")
        priced = upstream.priced[model]
        return Routed(upstream, priced, upstream.sent.get(model, model),
                      upstream.price_keys.get(model, priced))


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
    for model, exact in by_model.items():
        prefix, _, rest = model.partition("/")
        if prefix in by_name and rest in by_name[prefix].priced:
            # resolve() would take the exact name and never reach the other: one name, two
            # models, so the file is refused as a name two upstreams serve is at the call.
            raise UpstreamsError(
                f"CEILING_UPSTREAMS: model {model!r} is both upstream "
                f"{' and '.join(map(repr, exact))}'s exact name and upstream {prefix!r}'s "
                f"{rest!r} (as `<name>/<model>`): a name resolves to exactly one upstream; "
                "rename or drop one of them")
    return Upstreams(by_name, {m: tuple(ns) for m, ns in by_model.items()})


def _upstream(index: int, entry: object, env: Mapping[str, str]) -> UpstreamDef:
    where = f"CEILING_UPSTREAMS: upstream {index}"
    if not isinstance(entry, dict):
        raise UpstreamsError(f"{where} is not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not UPSTREAM_NAME.fullmatch(name):
        raise UpstreamsError(f"{where}: `name` must match {UPSTREAM_NAME.pattern}")
    where = f"CEILING_UPSTREAMS: upstream {name!r}"
    kind = KINDS.get(str(entry.get("api")))
    if kind is None:
        raise UpstreamsError(f"{where}: `api` must be one of {', '.join(KINDS)}")
    unknown = set(entry) - COMMON_FIELDS - kind.fields
    if unknown:
        raise UpstreamsError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} for a "
                             f"{kind.name} upstream")
    base_url = _base_url(where, entry.get("base_url"), kind)
    prices_provider = entry.get("prices_provider", kind.prices_provider)
    if not isinstance(prices_provider, str) or not prices_provider:
        raise UpstreamsError(f"{where}: `prices_provider` is a genai-prices provider id, such "
                             f"as {kind.prices_provider!r}")
    place = {key: text(where, key, entry.get(key), required=True)
             for key in PLACE_FIELDS if key in kind.fields}
    definition = kind.read(where, entry, env, UpstreamDef(
        name=name, api=kind.name, base_url=base_url, prices_provider=prices_provider,
        priced={m: m for m in names(where, "models", entry.get("models", []))},
        api_key=_api_key(where, entry.get("api_key_env"), kind, env),
        region=place.get("region"), project=place.get("project")))
    if not definition.priced:
        raise UpstreamsError(f"{where} serves no model: list them in `models`"
                             + "".join(f" or `{key}`" for key in kind.model_fields))
    # By the name a call names, as what is sent (and so the price: Bedrock's by where it runs)
    # may differ between two names of one priced model.
    keys = {named: key for named, model in definition.priced.items()
            if (key := kind.price_key(definition, model, definition.sent.get(named, named)))
            != model}
    return replace(definition, price_keys=keys) if keys else definition


def _base_url(where: str, value: object, kind: UpstreamKind) -> str | None:
    if value is None and kind.base_url_optional:
        return None
    if not isinstance(value, str) or not value.startswith(("https://", "http://")):
        raise UpstreamsError(f"{where}: `base_url` must be an http(s) URL")
    return value.rstrip("/")


def _api_key(where: str, env_name: object, kind: UpstreamKind,
             env: Mapping[str, str]) -> str | None:
    if not kind.keyed:
        if env_name is not None:
            raise UpstreamsError(f"{where}: a {kind.name} upstream authenticates without "
                                 "`api_key_env`")
        return None
    if env_name is None:
        return None  # a local OpenAI-compatible server may take no key
    if not isinstance(env_name, str) or not env.get(env_name):
        raise UpstreamsError(f"{where}: `api_key_env` names {env_name!r}, which is not set")
    return env[env_name]
