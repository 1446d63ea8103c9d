"""The keyed kinds' client (api/upstreams/keyed.py): one key, put where the provider of the kind's
formats takes it, so a kind serving two providers' formats is refused at startup rather than
sending one provider's calls with their key where only the other reads it."""

from __future__ import annotations

import pytest

import core.upstreams
from api.upstreams import keyed
from core.config import ConfigError
from core.formats import FORMATS
from core.ledger import Upstream
from core.upstream_kinds import KINDS
from core.upstream_kinds.kind import UpstreamDef, UpstreamKind

KEYED = [kind for kind in KINDS.values() if kind.client == "keyed"]


def definition(kind: UpstreamKind) -> UpstreamDef:
    return UpstreamDef(name="up", api=kind.name, base_url="http://127.0.0.1:9",
                       prices_provider=kind.prices_provider, priced={}, api_key="key")


@pytest.mark.parametrize("kind", KEYED, ids=[kind.name for kind in KEYED])
def test_every_keyed_kind_serves_one_providers_formats(kind: UpstreamKind) -> None:
    providers = {wire.provider.upstream for wire in FORMATS.values()
                 if wire.routed_as in kind.routes}
    assert len(providers) == 1, (kind.name, providers)
    assert keyed.key_provider(kind).upstream in providers
    keyed.client(definition(kind), 1.0)


def test_a_keyed_kind_of_two_providers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chat (a bearer key) and Messages (`x-api-key`) under one kind: whichever format came
    first would have placed the key for both."""
    mixed = UpstreamKind("mixed", frozenset({"chat", "messages"}), "openai", Upstream.OPENAI,
                         "keyed")
    monkeypatch.setitem(core.upstreams.KINDS, mixed.name, mixed)  # type: ignore[index]
    with pytest.raises(ConfigError, match=r"'mixed'.*anthropic.*openai"):
        keyed.client(definition(mixed), 1.0)
