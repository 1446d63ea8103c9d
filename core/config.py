"""Configuration from the environment (names in docs/reference.md), read and checked once.

A configuration that cannot hold the ceiling is refused here, at load, with a message that says
how to fix it: a lease shorter than the upstream timeout would let a slow call's budget be
granted twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from core import upstreams
from core.errors import InvalidRequest
from core.ledger import ExpirePolicy, Upstream
from core.limits import RESERVATION_TTL_MS_MAX, RESERVATION_TTL_MS_MIN, TOKENS_MAX
from core.upstreams import Upstreams

# Upstream calls longer than ten minutes are not LLM calls we can hold a lease for.
UPSTREAM_TIMEOUT_S_DEFAULT = 600.0
# The lease outlives the upstream timeout by this much: the settle after a call that used its
# whole timeout still finds its lease open.
LEASE_MARGIN_MS = 60_000
# The output cap the gateway sets (and reserves for) on a call that sets none: without one there
# is no worst case. Enough for nearly every chat answer; a caller that wants more says so.
OUTPUT_TOKENS_DEFAULT = 4_096
# Replicas a reserve may be made to wait for (Redis WAIT): past a handful, a primary's
# replicas are a read fleet, not copies a failover promotes.
WAIT_REPLICAS_MAX = 16
# How long a reserve waits for its replicas, by default and at most: a loopback or same-zone
# replica acknowledges in well under a millisecond, so 50 ms is a replica that is behind; the
# bound stays far inside the ledger call's own time limit (core/stores/redis.py
# LEDGER_CALL_TIMEOUT_S), and every call on the instance's connection waits behind a WAIT.
WAIT_TIMEOUT_MS_DEFAULT = 50
WAIT_TIMEOUT_MS_MAX = 1_000


class ConfigError(InvalidRequest):
    """The environment does not describe a service that can enforce; the message says why."""

    code = "invalid_configuration"


@dataclass(frozen=True)
class Config:
    redis_url: str | None = None
    redis_cluster: bool = False
    upstash_url: str | None = None
    upstash_token: str | None = None
    single_replica: bool = False
    admin_token: str | None = None
    upstream_url: str | None = None
    upstream_api_key: str | None = None
    # Anthropic's Messages API (POST /v1/messages): the SDK's base URL, without /v1.
    anthropic_url: str | None = None
    anthropic_api_key: str | None = None
    upstream_timeout_s: float = UPSTREAM_TIMEOUT_S_DEFAULT
    lease_ttl_ms: int = math.ceil(UPSTREAM_TIMEOUT_S_DEFAULT * 1000) + LEASE_MARGIN_MS
    prices_file: str | None = None
    expire_policy: ExpirePolicy = ExpirePolicy.CHARGE
    output_tokens_default: int = OUTPUT_TOKENS_DEFAULT
    # Alerts: where alert events are posted, and the secret that signs them.
    alert_webhook_url: str | None = None
    alert_webhook_secret: str | None = None
    alert_delivery_interval_s: float = 5.0
    # Hold a model's p95 output instead of the cap while a budget is far from its ceiling: more
    # calls at once, but a bill that can pass the ceiling (core/gateway.py, hold()).
    hold_p95: bool = False
    # Top-level request fields the gateway forwards besides its routes' own allow-lists
    # (core/gateway.py ALLOWED_FIELDS): an operator's, for fields of its upstream that bill
    # nothing (CEILING_GATEWAY_FIELDS_ALLOWED, comma-separated).
    gateway_fields_allowed: frozenset[str] = frozenset()
    # anthropic-beta values the operator declares cost-neutral, beside those the gateway knows
    # (core/formats/messages.py MESSAGES_BETAS; CEILING_GATEWAY_BETAS_ALLOWED, comma-separated).
    gateway_betas_allowed: frozenset[str] = frozenset()
    # Durability (docs/guarantees.md "Faults"): replicas a reserve is acknowledged by before the
    # call goes on (CEILING_REDIS_WAIT_REPLICAS), and how long it waits for them.
    wait_replicas: int = 0
    wait_timeout_ms: int = WAIT_TIMEOUT_MS_DEFAULT
    # A ledger whose Redis only snapshots (or keeps nothing), or may evict keys, loses money on
    # a crash or under memory pressure; `ceiling serve` refuses it unless the operator accepts
    # that here (CEILING_ACCEPT_NOT_DURABLE, CEILING_ACCEPT_EVICTION); health then says degraded.
    accept_not_durable: bool = False
    accept_eviction: bool = False
    # Where the outage journal is kept so that a restarted instance books it (core/outage.py);
    # None: in memory only.
    outage_journal_dir: str | None = None
    # Named upstreams (CEILING_UPSTREAMS, core/upstreams.py): where each model's calls go and
    # whose prices hold them. None: the one-upstream shorthands (CEILING_UPSTREAM_URL,
    # CEILING_ANTHROPIC_URL) carry every call, as they name no models.
    upstreams: Upstreams | None = None
    # The bill an operator names for a one-upstream shorthand's provider, by its URL setting
    # (SHORTHAND_BILL_SETTINGS): a proxy in front of the provider's own API. Without one, its
    # calls are on the provider's bill only at the provider's own host (core/upstream_kinds/
    # kind.py bill_at), else on Upstream.OTHER's.
    shorthand_bills: Mapping[str, Upstream] = field(default_factory=dict)


# The setting that names a shorthand's bill, by its URL setting (Config.shorthand_bills).
SHORTHAND_BILL_SETTINGS = {"CEILING_UPSTREAM_URL": "CEILING_UPSTREAM_BILL",
                           "CEILING_ANTHROPIC_URL": "CEILING_ANTHROPIC_BILL"}


def _shorthand_bills(env: Mapping[str, str]) -> dict[str, Upstream]:
    found = {}
    bills = [u.value for u in Upstream if u is not Upstream.UNATTRIBUTED]
    for url_setting, setting in SHORTHAND_BILL_SETTINGS.items():
        value = env.get(setting, "").strip()
        if not value:
            continue
        if value not in bills:
            raise ConfigError(f"{setting} must be one of {', '.join(bills)}")
        found[url_setting] = Upstream(value)
    return found


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ConfigError(f"{name} must be 1 or 0, not {value!r}")


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be a number, not {raw!r}") from exc
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number, not {raw!r}")
    return value


# Upstash's own names, then Vercel KV's (which is Upstash); a pair is used whole or not at all.
UPSTASH_ENV_PAIRS = (
    ("UPSTASH_REDIS_REST_URL", "UPSTASH_REDIS_REST_TOKEN"),
    ("KV_REST_API_URL", "KV_REST_API_TOKEN"),
)


def _upstash(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    for url_var, token_var in UPSTASH_ENV_PAIRS:
        url, token = env.get(url_var, ""), env.get(token_var, "")
        if url and token:
            if not url.startswith(("https://", "http://")):
                # Upstash's console shows a rediss:// URL beside the REST one; this is the REST one.
                raise ConfigError(f"{url_var} must be the REST URL (https://...)")
            return url.rstrip("/"), token
        if url or token:
            given, missing = (url_var, token_var) if url else (token_var, url_var)
            raise ConfigError(f"{given} is set but {missing} is not; set both to use Upstash")
    return None, None


def load(env: Mapping[str, str]) -> Config:
    upstream_timeout_s = _number(env, "CEILING_UPSTREAM_TIMEOUT_S", UPSTREAM_TIMEOUT_S_DEFAULT)
    floor_ms = math.ceil(upstream_timeout_s * 1000) + LEASE_MARGIN_MS
    default_ttl_ms = min(max(floor_ms, RESERVATION_TTL_MS_MIN), RESERVATION_TTL_MS_MAX)
    lease_ttl_ms = int(_number(env, "CEILING_LEASE_TTL_MS", default_ttl_ms))
    if not RESERVATION_TTL_MS_MIN <= lease_ttl_ms <= RESERVATION_TTL_MS_MAX:
        raise ConfigError(
            f"CEILING_LEASE_TTL_MS must be from {RESERVATION_TTL_MS_MIN} to "
            f"{RESERVATION_TTL_MS_MAX}"
        )
    if lease_ttl_ms < floor_ms:
        raise ConfigError(
            f"CEILING_LEASE_TTL_MS={lease_ttl_ms} is shorter than the upstream timeout "
            f"({upstream_timeout_s} s) plus {LEASE_MARGIN_MS} ms: a slow call's lease would "
            "expire while it runs and its budget could be granted twice. Raise "
            "CEILING_LEASE_TTL_MS or lower CEILING_UPSTREAM_TIMEOUT_S."
        )
    output_tokens_default = _number(env, "CEILING_DEFAULT_MAX_OUTPUT_TOKENS", OUTPUT_TOKENS_DEFAULT)
    if output_tokens_default != int(output_tokens_default) or output_tokens_default > TOKENS_MAX:
        raise ConfigError(
            f"CEILING_DEFAULT_MAX_OUTPUT_TOKENS must be an integer up to {TOKENS_MAX}"
        )
    policy = env.get("CEILING_EXPIRE_POLICY", "charge").strip() or "charge"
    if policy not in ExpirePolicy.__members__.values():
        raise ConfigError("CEILING_EXPIRE_POLICY must be 'charge' or 'release'")
    upstash_url, upstash_token = _upstash(env)
    anthropic_url = env.get("CEILING_ANTHROPIC_URL", "").strip().rstrip("/") or None
    if anthropic_url is not None:
        if not anthropic_url.startswith(("https://", "http://")):
            raise ConfigError("CEILING_ANTHROPIC_URL must be an http(s) URL, such as "
                              "https://api.anthropic.com")
        if anthropic_url.endswith("/v1"):
            # The gateway adds /v1/messages: a base URL ending in /v1 would call /v1/v1/messages.
            raise ConfigError("CEILING_ANTHROPIC_URL is the base URL without /v1, as the "
                              "anthropic SDK takes it: https://api.anthropic.com")
    alert_url, alert_secret = _alert_webhook(env)
    redis_url = env.get("REDIS_URL") or None
    if redis_url and not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("REDIS_URL must start with redis://, rediss:// or unix://")
    wait_replicas, wait_timeout_ms = _wait(env, redis_url, _flag(env, "REDIS_CLUSTER"))
    return Config(
        redis_url=redis_url,
        redis_cluster=_flag(env, "REDIS_CLUSTER"),
        upstash_url=upstash_url,
        upstash_token=upstash_token,
        single_replica=_flag(env, "CEILING_SINGLE_REPLICA"),
        admin_token=env.get("CEILING_ADMIN_TOKEN") or None,
        upstream_url=env.get("CEILING_UPSTREAM_URL") or None,
        upstream_api_key=env.get("CEILING_UPSTREAM_API_KEY") or None,
        anthropic_url=anthropic_url,
        anthropic_api_key=env.get("CEILING_ANTHROPIC_API_KEY") or None,
        upstream_timeout_s=upstream_timeout_s,
        lease_ttl_ms=lease_ttl_ms,
        prices_file=env.get("CEILING_PRICES_FILE") or None,
        expire_policy=ExpirePolicy(policy),
        output_tokens_default=int(output_tokens_default),
        hold_p95=_flag(env, "CEILING_HOLD_P95"),
        gateway_fields_allowed=_field_names(env, "CEILING_GATEWAY_FIELDS_ALLOWED"),
        gateway_betas_allowed=_field_names(env, "CEILING_GATEWAY_BETAS_ALLOWED", _BETA_NAME),
        alert_webhook_url=alert_url,
        alert_webhook_secret=alert_secret,
        alert_delivery_interval_s=_delivery_interval_s(env),
        wait_replicas=wait_replicas,
        wait_timeout_ms=wait_timeout_ms,
        accept_not_durable=_flag(env, "CEILING_ACCEPT_NOT_DURABLE"),
        accept_eviction=_flag(env, "CEILING_ACCEPT_EVICTION"),
        outage_journal_dir=env.get("CEILING_OUTAGE_JOURNAL_DIR", "").strip() or None,
        upstreams=_upstreams(env),
        shorthand_bills=_shorthand_bills(env),
    )


def _upstreams(env: Mapping[str, str]) -> Upstreams | None:
    """CEILING_UPSTREAMS' file, read once at load; its errors are UpstreamsError (a ConfigError
    to every caller of load: both are invalid_configuration)."""
    path = env.get("CEILING_UPSTREAMS", "").strip()
    return upstreams.load(path, env) if path else None


def _whole(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ConfigError(f"{name} must be a whole number from {low} to {high}, not {raw!r}")
    return int(raw)


def _wait(env: Mapping[str, str], redis_url: str | None, cluster: bool) -> tuple[int, int]:
    """CEILING_REDIS_WAIT_REPLICAS and CEILING_REDIS_WAIT_TIMEOUT_MS. WAIT counts the replicas
    that acknowledged the writes of the connection it is sent on, so it is carried out only where
    the reserve and the WAIT share one connection: one Redis (REDIS_URL). Upstash's REST API
    sends each command on a connection of its own and replicates as its service does; a Redis
    Cluster's reserve goes to one of many masters through a client that picks connections by
    slot. Both refuse the setting here rather than accept a guarantee they would not keep."""
    replicas = _whole(env, "CEILING_REDIS_WAIT_REPLICAS", 0, 0, WAIT_REPLICAS_MAX)
    timeout_ms = _whole(env, "CEILING_REDIS_WAIT_TIMEOUT_MS", WAIT_TIMEOUT_MS_DEFAULT, 1,
                        WAIT_TIMEOUT_MS_MAX)
    if replicas and (not redis_url or cluster):
        raise ConfigError(
            "CEILING_REDIS_WAIT_REPLICAS is carried out on one Redis (REDIS_URL) only: on a "
            "Redis Cluster or Upstash a reserve cannot be made to wait for its replicas; unset it")
    return replicas, timeout_ms


# A field name an operator may allow: JSON keys as providers name their fields.
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


# A beta flag an operator may allow: Anthropic names them `<feature>-<YYYY-MM-DD>`.
_BETA_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{0,99}")


def _field_names(env: Mapping[str, str], name: str,
                 pattern: re.Pattern[str] = _FIELD_NAME) -> frozenset[str]:
    names = frozenset(n.strip() for n in env.get(name, "").split(",") if n.strip())
    bad = sorted(n for n in names if not pattern.fullmatch(n))
    if bad:
        raise ConfigError(f"{name} must be comma-separated names, not {bad[0]!r}")
    return names


# A long-running instance's delivery passes: from a tenth of a second (tests, a busy ledger) to
# an hour (an operator who delivers from a scheduler only).
ALERT_DELIVERY_INTERVAL_S_MIN = 0.1
ALERT_DELIVERY_INTERVAL_S_MAX = 3600.0


def _delivery_interval_s(env: Mapping[str, str]) -> float:
    interval_s = _number(env, "CEILING_ALERT_DELIVERY_INTERVAL_S", 5.0)
    if not ALERT_DELIVERY_INTERVAL_S_MIN <= interval_s <= ALERT_DELIVERY_INTERVAL_S_MAX:
        raise ConfigError(
            f"CEILING_ALERT_DELIVERY_INTERVAL_S must be from {ALERT_DELIVERY_INTERVAL_S_MIN} to "
            f"{ALERT_DELIVERY_INTERVAL_S_MAX}")
    return interval_s


def _alert_webhook(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """CEILING_ALERT_WEBHOOK_URL and its secret. An unsigned event could be forged by anyone
    who learns the URL, so a secret is required, except for a Slack incoming webhook (Slack
    reads no signature; its URL is the secret)."""
    from core.alerts import is_slack

    url = env.get("CEILING_ALERT_WEBHOOK_URL", "").strip() or None
    secret = env.get("CEILING_ALERT_WEBHOOK_SECRET") or None
    if url is None:
        return None, secret
    if not url.startswith(("https://", "http://")):
        raise ConfigError("CEILING_ALERT_WEBHOOK_URL must be an http(s) URL")
    if secret is None and not is_slack(url):
        raise ConfigError("CEILING_ALERT_WEBHOOK_URL is set but CEILING_ALERT_WEBHOOK_SECRET is "
                          "not: receivers check the x-ceiling-signature it makes")
    return url, secret
