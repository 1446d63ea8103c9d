"""Where a store is made: the one module that picks a backend and imports core/stores/.

The environment names the ledger (core/config.py); this makes its store and the capabilities
that go with it, and callers take from the result the protocols they use (core/ledger.py).
The operators' catalogue is passed on from here explicitly, as a value that may be None, so no
caller has to find out what class a store is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.config import Config
from core.ledger import LedgerStore
from core.stores.operations import ScriptedCatalogue
from core.stores.scripted import ScriptedStore

if TYPE_CHECKING:  # core.operations is the admin side: not imported on a call's path
    from core.operations import Catalogue


@dataclass(frozen=True)
class Backend:
    """A store and its optional capabilities."""

    store: LedgerStore
    catalogue: Catalogue | None


def scripted(store: ScriptedStore) -> Backend:
    """A store that runs the lua/ scripts, with the catalogue it keeps beside its ledger."""
    return Backend(store, ScriptedCatalogue(store))


def open_backend(config: Config) -> Backend | None:
    """The ledger the environment names; None when only a per-instance ledger is possible.
    Each backend's client library is imported only when it is the one named."""
    if config.redis_url and config.redis_cluster:
        from core.stores.redis_cluster import RedisClusterStore

        return scripted(RedisClusterStore(config.redis_url))
    if config.redis_url:
        from core.stores.redis import RedisStore

        return scripted(RedisStore(config.redis_url, wait_replicas=config.wait_replicas,
                                   wait_timeout_ms=config.wait_timeout_ms))
    if config.upstash_url and config.upstash_token:
        from core.stores.upstash import UpstashStore

        return scripted(UpstashStore(config.upstash_url, config.upstash_token))
    if config.single_replica:
        from core.stores.memory import MemoryStore

        return scripted(MemoryStore())
    return None


async def migrate_ledger(store: LedgerStore, *, dry_run: bool) -> dict[str, Any]:
    """`ceiling ledger migrate`: the ledger `store` keeps brought to the current format
    (core/stores/migrate.py); what it found and did."""
    from core.stores.migrate import migrate  # the admin side: not imported on a call's path

    return (await migrate(store, dry_run=dry_run)).json()
