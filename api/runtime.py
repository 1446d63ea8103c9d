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
from pathlib import Path
from typing import TYPE_CHECKING

from core import __version__
from core.backends import Backend, open_backend
from core.config import Config, ConfigError, load
from core.errors import CeilingError, InvariantBroken, LedgerUnavailable
from core.ledger import LedgerStore
from core.prices import PriceTable
from core.service import CeilingService

if TYPE_CHECKING:
    from core.operations import Operations

# From the source, not the installed metadata: a deployed bundle (the Lambda zip, the Vercel
# function) carries the source without the distribution's metadata.
VERSION = __version__


@dataclass
class Runtime:
    instance_id: str
    config: Config | None
    service: CeilingService | None
    problem: CeilingError | None
    backend: Backend | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], instance_id: str | None = None) -> Runtime:
        instance_id = instance_id or uuid.uuid4().hex[:12]
        try:
            config = load(env)
            prices = PriceTable.from_file(config.prices_file)
        except CeilingError as exc:
            problem = exc if isinstance(exc, ConfigError) else ConfigError(exc.message)
            return cls(instance_id, None, None, problem)
        backend = open_backend(config)
        if backend is None:
            return cls(instance_id, config, None, LedgerUnavailable(
                "no shared ledger is configured: set REDIS_URL (or UPSTASH_REDIS_REST_URL and "
                "UPSTASH_REDIS_REST_TOKEN); for one replica only, set CEILING_SINGLE_REPLICA=1",
                reason="ledger_not_shared",
            ))
        service = CeilingService(
            backend.store, prices, lease_ttl_ms=config.lease_ttl_ms,
            expire_policy=config.expire_policy,
        )
        if config.outage_journal_dir:
            try:
                service.outage.keep_in(Path(config.outage_journal_dir), instance_id)
            except OSError as exc:
                return cls(instance_id, config, None, ConfigError(
                    f"CEILING_OUTAGE_JOURNAL_DIR: the outage journal cannot be kept in "
                    f"{config.outage_journal_dir}: {exc}"))
        return cls(instance_id, config, service, None, backend)

    def enforcing(self) -> CeilingService:
        """The service, or the reason this instance refuses to enforce (fail closed)."""
        if self.service is None:
            raise self.problem or InvariantBroken("a runtime has a service or a problem")
        return self.service

    def store(self) -> LedgerStore:
        """The whole store behind the service, for what is not on a call's path (health, the
        spend page, alerts, idempotency keys); as enforcing() when there is none."""
        self.enforcing()
        if self.backend is None:
            raise InvariantBroken("a runtime with a service has its backend")
        return self.backend.store

    async def ledger_unaccepted(self) -> str | None:
        """Why the shared ledger cannot keep money and the operator did not accept it, or None:
        `ceiling serve` refuses to start then. A ledger that cannot be reached now is not
        refused here: calls fail closed until it is. Closes the store it probed (its
        connections belong to this call's event loop)."""
        store, config = self.store(), self.config
        try:
            probe = await store.probe(self.instance_id)
        finally:
            await store.close()
        if not probe.shared or config is None:
            return None  # the memory ledger, which CEILING_SINGLE_REPLICA accepted whole
        why = []
        if "ledger_not_durable" in probe.reasons and not config.accept_not_durable:
            why.append("the ledger's Redis logs no writes (aof_enabled:0: snapshots at most), so "
                       "a crash loses the spend since its last snapshot; turn on appendonly, or "
                       "set CEILING_ACCEPT_NOT_DURABLE=1 to serve it anyway (health: degraded)")
        if "ledger_evicts" in probe.reasons and not config.accept_eviction:
            why.append("the ledger's Redis may evict keys (maxmemory_policy is not noeviction, "
                       "or it evicted some), and an evicted hold or counter is spend forgotten; "
                       "set maxmemory-policy noeviction, or CEILING_ACCEPT_EVICTION=1 to serve "
                       "it anyway (health: degraded)")
        return "; ".join(why) or None

    def operations(self) -> Operations:
        """The admin operations, with the catalogue the store keeps (if it keeps one)."""
        from core.operations import Operations  # the admin side: off a call's path

        service = self.enforcing()
        return Operations(service, self.backend.catalogue if self.backend else None)


_runtime: Runtime | None = None
# The id the process' runtime takes when it is made; None: a new one (`serving_as`).
_instance_id: str | None = None


def serving_as(instance_id: str) -> None:
    """The process' runtime, once made, is instance `instance_id`: the one `ceiling serve`'s
    start-up probe registered with the ledger, so that health counts it once, not twice."""
    global _instance_id
    _instance_id = instance_id


def runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        _runtime = Runtime.from_env(os.environ, _instance_id)
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
