import json
import pathlib

import pytest

from core.config import ConfigError, load
from core.errors import InvalidRequest
from core.ledger import ExpirePolicy


def test_defaults_hold_a_lease_past_the_upstream_timeout() -> None:
    config = load({})
    assert config.lease_ttl_ms >= config.upstream_timeout_s * 1000
    assert config.expire_policy is ExpirePolicy.CHARGE
    assert (config.redis_url, config.upstash_url, config.single_replica) == (None, None, False)


def test_a_lease_shorter_than_the_upstream_timeout_is_refused() -> None:
    with pytest.raises(ConfigError, match="CEILING_LEASE_TTL_MS"):
        load({"CEILING_UPSTREAM_TIMEOUT_S": "120", "CEILING_LEASE_TTL_MS": "60000"})
    assert load({"CEILING_UPSTREAM_TIMEOUT_S": "30"}).lease_ttl_ms == 90_000


@pytest.mark.parametrize("env", [
    {"UPSTASH_REDIS_REST_URL": "https://x.upstash.io"},
    {"KV_REST_API_TOKEN": "t"},
    {"UPSTASH_REDIS_REST_URL": "rediss://x.upstash.io", "UPSTASH_REDIS_REST_TOKEN": "t"},
    {"REDIS_URL": "http://x"},
    {"CEILING_SINGLE_REPLICA": "maybe"},
    {"CEILING_UPSTREAM_TIMEOUT_S": "-1"},
    {"CEILING_EXPIRE_POLICY": "forgive"},
    {"CEILING_ANTHROPIC_URL": "api.anthropic.com"},
    {"CEILING_ANTHROPIC_URL": "https://api.anthropic.com/v1"},
    {"CEILING_GATEWAY_FIELDS_ALLOWED": "transforms, not a name"},
])
def test_configurations_that_cannot_enforce_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        load(env)


def test_vercel_kv_names_are_accepted() -> None:
    config = load({"KV_REST_API_URL": "https://kv.example/", "KV_REST_API_TOKEN": "t"})
    assert (config.upstash_url, config.upstash_token) == ("https://kv.example", "t")


def test_the_anthropic_provider_is_the_sdks_base_url() -> None:
    config = load({"CEILING_ANTHROPIC_URL": "https://api.anthropic.com/",
                   "CEILING_ANTHROPIC_API_KEY": "sk-ant"})
    assert (config.anthropic_url, config.anthropic_api_key) == ("https://api.anthropic.com",
                                                                "sk-ant")
    assert (load({}).anthropic_url, load({}).anthropic_api_key) == (None, None)


def test_an_operator_names_the_fields_it_allows() -> None:
    config = load({"CEILING_GATEWAY_FIELDS_ALLOWED": "transforms, route ,"})
    assert config.gateway_fields_allowed == frozenset({"transforms", "route"})
    assert load({}).gateway_fields_allowed == frozenset()


def test_upstreams_are_read_at_load_and_their_errors_are_configuration_errors(
        tmp_path: pathlib.Path) -> None:
    assert load({}).upstreams is None  # the one-upstream shorthands carry every call
    path = tmp_path / "upstreams.json"
    path.write_text(json.dumps({"upstreams": [{
        "name": "router", "api": "openai", "base_url": "https://openrouter.ai/api/v1",
        "api_key_env": "ROUTER_KEY", "models": ["openai/gpt-5"]}]}))
    config = load({"CEILING_UPSTREAMS": str(path), "ROUTER_KEY": "k"})
    assert config.upstreams is not None
    assert config.upstreams.resolve("router/openai/gpt-5", "chat").upstream.api_key == "k"
    with pytest.raises(InvalidRequest, match="ROUTER_KEY") as unset:
        load({"CEILING_UPSTREAMS": str(path)})
    assert unset.value.code == "invalid_configuration"
    with pytest.raises(InvalidRequest, match="cannot read") as missing:
        load({"CEILING_UPSTREAMS": str(tmp_path / "nowhere.json")})
    assert missing.value.code == "invalid_configuration"
