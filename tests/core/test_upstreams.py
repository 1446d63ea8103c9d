"""Named upstreams (core/upstreams.py): a model reaches exactly one upstream, or none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.ledger import Upstream
from core.upstreams import ModelNotRouted, UpstreamsError, bill_of, load, parse

ENV = {"OPENAI_KEY": "sk-1", "ROUTER_KEY": "sk-2", "AZ_KEY": "az", "AWS_ACCESS_KEY_ID": "AKIA",
       "AWS_SECRET_ACCESS_KEY": "secret"}


def doc(*upstreams: dict[str, Any]) -> dict[str, Any]:
    return {"upstreams": list(upstreams)}


OPENAI = {"name": "openai", "api": "openai", "base_url": "https://api.openai.com/v1",
          "api_key_env": "OPENAI_KEY", "models": ["gpt-5-mini", "gpt-5"]}
ROUTER = {"name": "router", "api": "openai", "base_url": "https://openrouter.ai/api/v1",
          "api_key_env": "ROUTER_KEY", "models": ["openai/gpt-5", "gpt-5"],
          "prices_provider": "openrouter"}
AZURE = {"name": "azure", "api": "azure", "base_url": "https://r.openai.azure.com/openai/v1",
         "api_key_env": "AZ_KEY", "deployments": {"prod-mini": "gpt-5-mini"}}
BEDROCK = {"name": "bedrock", "api": "bedrock", "region": "us-east-1",
           "model_ids": {"claude-sonnet-4-5": "us.anthropic.claude-sonnet-4-5-20250929-v1:0"}}


def test_a_model_resolves_by_its_exact_name_to_the_one_upstream_that_serves_it() -> None:
    ups = parse(doc(OPENAI, AZURE), ENV)
    routed = ups.resolve("gpt-5", "chat")
    assert (routed.upstream.name, routed.priced_model, routed.sent_model) == (
        "openai", "gpt-5", "gpt-5")
    assert routed.upstream.api_key == "sk-1"
    assert routed.upstream.prices_provider == "openai"


def test_a_model_no_upstream_names_is_refused_and_names_the_fix() -> None:
    ups = parse(doc(OPENAI), ENV)
    with pytest.raises(ModelNotRouted, match="no upstream in CEILING_UPSTREAMS serves model"):
        ups.resolve("gpt-4o", "chat")


def test_a_name_two_upstreams_serve_needs_the_prefix_and_the_prefix_reaches_each() -> None:
    ups = parse(doc(OPENAI, ROUTER), ENV)
    with pytest.raises(ModelNotRouted, match="openai/gpt-5 or router/gpt-5"):
        ups.resolve("gpt-5", "chat")
    assert ups.resolve("router/gpt-5", "chat").upstream.name == "router"
    assert ups.resolve("router/gpt-5", "chat").sent_model == "gpt-5"
    assert ups.resolve("openai/gpt-5-mini", "responses").upstream.name == "openai"


def test_a_provider_name_with_a_slash_is_an_exact_name_before_a_prefix() -> None:
    ups = parse(doc(OPENAI, ROUTER), ENV)
    routed = ups.resolve("openai/gpt-5", "chat")  # the exact name on the router wins
    assert routed.upstream.name == "router"
    assert routed.sent_model == "openai/gpt-5"


def test_a_prefix_reaches_only_what_that_upstream_serves() -> None:
    ups = parse(doc(OPENAI, BEDROCK), ENV)
    with pytest.raises(ModelNotRouted):
        ups.resolve("openai/claude-sonnet-4-5", "messages")
    with pytest.raises(ModelNotRouted):
        ups.resolve("nowhere/gpt-5", "chat")


def test_a_model_on_the_wrong_route_is_refused() -> None:
    ups = parse(doc(OPENAI, BEDROCK), ENV)
    with pytest.raises(ModelNotRouted, match="serves the messages route"):
        ups.resolve("claude-sonnet-4-5", "chat")
    with pytest.raises(ModelNotRouted, match="not messages"):
        ups.resolve("gpt-5", "messages")


def test_an_azure_deployment_is_priced_as_the_model_it_deploys() -> None:
    routed = parse(doc(AZURE), ENV).resolve("prod-mini", "responses")
    assert (routed.priced_model, routed.sent_model) == ("gpt-5-mini", "prod-mini")
    assert routed.upstream.prices_provider == "azure"


def test_a_bedrock_model_is_sent_by_its_id_and_its_id_is_priced_as_the_model() -> None:
    ups = parse(doc(BEDROCK), ENV)
    routed = ups.resolve("claude-sonnet-4-5", "messages")
    assert routed.sent_model == "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
    assert routed.upstream.prices_provider == "aws"
    by_id = ups.resolve("us.anthropic.claude-sonnet-4-5-20250929-v1:0", "messages")
    assert by_id.priced_model == "claude-sonnet-4-5"
    assert routed.upstream.signing_credentials == ("AKIA", "secret", None)


@pytest.mark.parametrize(("entry", "message"), [
    ({**OPENAI, "api_key_env": "MISSING"}, "not set"),
    ({**OPENAI, "modles": ["x"]}, "unknown field"),
    ({**OPENAI, "api": "cohere"}, "`api` must be one of"),
    ({**OPENAI, "name": "a/b"}, "`name` must match"),
    ({**OPENAI, "base_url": "ftp://x"}, "http"),
    ({**OPENAI, "models": []}, "serves no model"),
    ({**OPENAI, "models": ["ok", 3]}, "list of model names"),
    ({**AZURE, "region": "eu"}, "unknown field"),
    ({**BEDROCK, "api_key_env": "AZ_KEY"}, "without `api_key_env`"),
    ({**BEDROCK, "region": None}, "`region` is required"),
    ({"name": "v", "api": "vertex", "project": "p", "region": "us-east5",
      "credentials_file": "/nonexistent.json", "models": ["gemini-2.5-pro"]}, "credentials_file"),
])
def test_a_file_that_cannot_route_is_refused_at_load(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(UpstreamsError, match=message):
        parse(doc(entry), ENV)


def test_bedrock_needs_aws_credentials_and_names_are_unique() -> None:
    with pytest.raises(UpstreamsError, match="AWS_ACCESS_KEY_ID"):
        parse(doc(BEDROCK), {})
    with pytest.raises(UpstreamsError, match="two upstreams are named"):
        parse(doc(OPENAI, {**ROUTER, "name": "openai"}), ENV)
    with pytest.raises(UpstreamsError, match="non-empty"):
        parse({"upstreams": []}, ENV)


def test_load_reads_the_file_and_refuses_what_is_not_json(tmp_path: Path) -> None:
    good = tmp_path / "up.json"
    good.write_text(json.dumps(doc(OPENAI)))
    assert load(str(good), ENV).by_name["openai"].api == "openai"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(UpstreamsError, match="not JSON"):
        load(str(bad), ENV)
    with pytest.raises(UpstreamsError, match="cannot read"):
        load(str(tmp_path / "none.json"), ENV)


def test_each_upstream_is_on_its_own_bill() -> None:
    ups = parse(doc(OPENAI, ROUTER, AZURE, BEDROCK), ENV).by_name
    assert {name: bill_of(u) for name, u in ups.items()} == {
        "openai": Upstream.OPENAI, "router": Upstream.OTHER, "azure": Upstream.AZURE,
        "bedrock": Upstream.AWS}


def test_an_openai_compatible_upstream_is_openais_bill_only_at_openais_own_host() -> None:
    """Priced by OpenAI's table at another host (a router, a proxy, a local server), its spend
    counted as OpenAI's would hide spend made with an OpenAI key directly from reconcile."""
    elsewhere = {**OPENAI, "name": "groq", "base_url": "https://api.groq.com/openai/v1"}
    claude = {"name": "claude", "api": "anthropic", "base_url": "https://api.anthropic.com",
              "api_key_env": "OPENAI_KEY", "models": ["claude-sonnet-4-5"]}
    proxy = {**claude, "name": "proxy", "base_url": "https://llm-proxy.example.com",
             "models": ["claude-haiku-4-5"]}
    ups = parse(doc(OPENAI, elsewhere, claude, proxy), ENV).by_name
    assert {name: bill_of(u) for name, u in ups.items()} == {
        "openai": Upstream.OPENAI, "groq": Upstream.OTHER, "claude": Upstream.ANTHROPIC,
        "proxy": Upstream.OTHER}


def test_a_shorthands_calls_are_its_providers_bill_only_at_its_own_host() -> None:
    from core.config import ConfigError, load
    from core.formats.messages import ANTHROPIC
    from core.formats.openai import OPENAI as OPENAI_PROVIDER

    def bills(**env: str) -> tuple[Upstream, Upstream]:
        config = load({"REDIS_URL": "redis://localhost:1", **env})
        return OPENAI_PROVIDER.bill(config), ANTHROPIC.bill(config)

    assert bills() == (Upstream.OPENAI, Upstream.ANTHROPIC)  # the SDKs' own defaults
    assert bills(CEILING_UPSTREAM_URL="https://api.openai.com/v1",
                 CEILING_ANTHROPIC_URL="https://api.anthropic.com") == (
        Upstream.OPENAI, Upstream.ANTHROPIC)
    assert bills(CEILING_UPSTREAM_URL="https://openrouter.ai/api/v1",
                 CEILING_ANTHROPIC_URL="http://127.0.0.1:9") == (Upstream.OTHER, Upstream.OTHER)
    # An operator's proxy in front of the provider itself names its bill.
    assert bills(CEILING_UPSTREAM_URL="https://egress.corp/v1", CEILING_UPSTREAM_BILL="openai",
                 CEILING_ANTHROPIC_URL="https://egress.corp",
                 CEILING_ANTHROPIC_BILL="anthropic") == (Upstream.OPENAI, Upstream.ANTHROPIC)
    with pytest.raises(ConfigError, match="CEILING_UPSTREAM_BILL"):
        bills(CEILING_UPSTREAM_BILL="unattributed")
