"""One runtime per process: configuration, the ledger store and the service, made on first use.

Made lazily and kept at module scope, so a warm serverless instance reuses its Redis connection
pool across invocations while a cold start pays nothing before its first request. The ledger is
picked from the environment; a configuration that cannot enforce does not crash the instance
(mangum runs the lifespan on every invocation, and a failing start-up kills it): it is kept as
the reason that enforcement is refused and health is `down`.
"""

from __future__ import annotations

import hmac
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from core import __version__
from core.config import Config, ConfigError, load
from core.errors import CeilingError, InvariantBroken, LedgerUnavailable
from core.ledger import LedgerStore
from core.prices import PriceTable
from core.service import CeilingService

# From the source, not the installed metadata: a deployed bundle (the Lambda zip, the Vercel
# function) carries the source without the distribution's metadata.
VERSION = __version__


def open_store(config: Config) -> LedgerStore | None:
    """The ledger the environment names; None when only a per-instance ledger is possible."""
    if config.redis_url and config.redis_cluster:
        from core.stores.redis_cluster import RedisClusterStore

        return RedisClusterStore(config.redis_url)
    if config.redis_url:
        from core.stores.redis import RedisStore

        return RedisStore(config.redis_url)
    if config.upstash_url and config.upstash_token:
        from core.stores.upstash import UpstashStore

        return UpstashStore(config.upstash_url, config.upstash_token)
    if config.single_replica:
        from core.stores.memory import MemoryStore

        return MemoryStore()
    return None


@dataclass
class Runtime:
    instance_id: str
    config: Config | None
    service: CeilingService | None
    problem: CeilingError | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Runtime:
        instance_id = uuid.uuid4().hex[:12]
        try:
            config = load(env)
            prices = PriceTable.from_file(config.prices_file)
        except CeilingError as exc:
            problem = exc if isinstance(exc, ConfigError) else ConfigError(exc.message)
            return cls(instance_id, None, None, problem)
        store = open_store(config)
        if store is None:
            return cls(instance_id, config, None, LedgerUnavailable(
                "no shared ledger is configured: set REDIS_URL (or UPSTASH_REDIS_REST_URL and "
                "UPSTASH_REDIS_REST_TOKEN); for one replica only, set CEILING_SINGLE_REPLICA=1",
                reason="ledger_not_shared",
            ))
        service = CeilingService(
            store, prices, lease_ttl_ms=config.lease_ttl_ms, expire_policy=config.expire_policy
        )
        return cls(instance_id, config, service, None)

    def enforcing(self) -> CeilingService:
        """The service, or the reason this instance refuses to enforce (fail closed)."""
        if self.service is None:
            raise self.problem or InvariantBroken("a runtime has a service or a problem")
        return self.service


_runtime: Runtime | None = None


def runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        _runtime = Runtime.from_env(os.environ)
    return _runtime


def admin_token() -> str | None:
    """The operator's token (CEILING_ADMIN_TOKEN); None when it is unset or the configuration
    could not be read."""
    config = runtime().config
    return config.admin_token if config else None


def is_admin_token(given: str | None) -> bool:
    """`given` is the admin token (compared in constant time); never when none is set."""
    expected = admin_token()
    return bool(expected and given is not None
                and hmac.compare_digest(given.encode(), expected.encode()))
