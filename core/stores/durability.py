"""What a Redis says about keeping the ledger's money: persistence, eviction, and who it is.

Read from INFO, which managed Redis services answer where they refuse CONFIG. Three ways a
Redis loses acknowledged spend, each a health reason (docs/guarantees.md "Faults"):
- `ledger_not_durable`: it persists by snapshots only, or not at all (aof_enabled:0). A crash
  loses every write since the last snapshot: a restart serves refilled budgets.
- `ledger_evicts`: its maxmemory_policy is anything but `noeviction`, or it has evicted keys
  since it started. Under a `volatile-*` policy only keys with a TTL go, but open reservation
  records and period counters carry TTLs, so an evicted hold is spend the ledger forgot: no
  policy but `noeviction` keeps money.
- `ledger_rolled_back` (core/stores/scripted_core.py): the ledger went back in time. INFO's
  run_id and replication id say the server behind the endpoint changed (a restart, a failover);
  the tags' sequences say whether it came back with less than it had acknowledged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NOT_DURABLE = "ledger_not_durable"
EVICTS = "ledger_evicts"
ROLLED_BACK = "ledger_rolled_back"
# Fewer replicas connected than CEILING_REDIS_WAIT_REPLICAS: every reserve is refused.
NOT_REPLICATED = "ledger_not_replicated"
# The only maxmemory policy under which Redis never drops a key to make room.
POLICY_KEEPS_ALL = "noeviction"


@dataclass(frozen=True)
class Durability:
    """One Redis's (or, merged, a cluster's) INFO, as far as keeping money goes. None: not told."""

    # Whether every write is logged (AOF); False: snapshots at most, which INFO cannot tell
    # from no persistence at all (the `save` schedule is CONFIG's) and which loses as much.
    aof: bool | None = None
    eviction_policy: str | None = None
    evicted_keys: int | None = None
    # run_id changes on every start; master_replid on a start and on a promotion: together,
    # whether the server behind the endpoint is still the one an instance last probed.
    server_id: str | None = None
    # Replicas connected to it (INFO replication connected_slaves): what a reserve that must be
    # acknowledged by CEILING_REDIS_WAIT_REPLICAS of them can count on.
    replicas: int | None = None

    @property
    def durable(self) -> bool | None:
        return self.aof

    @property
    def evicts(self) -> bool:
        return bool((self.eviction_policy is not None and self.eviction_policy != POLICY_KEEPS_ALL)
                    or (self.evicted_keys or 0) > 0)

    def reasons(self) -> tuple[str, ...]:
        return tuple(r for r, bad in ((NOT_DURABLE, self.durable is False),
                                      (EVICTS, self.evicts)) if bad)

    def merged(self, other: Durability) -> Durability:
        """The weaker of two masters: a cluster keeps money only if every master does."""
        aof = None if self.aof is None and other.aof is None else (
            self.aof is not False and other.aof is not False)
        policy = next((p for p in (self.eviction_policy, other.eviction_policy)
                       if p is not None and p != POLICY_KEEPS_ALL),
                      self.eviction_policy or other.eviction_policy)
        evicted = (None if self.evicted_keys is None and other.evicted_keys is None
                   else (self.evicted_keys or 0) + (other.evicted_keys or 0))
        return Durability(aof, policy, evicted, None, None)


def info_fields(reply: Any) -> Mapping[str, Any]:
    """INFO's fields, from redis-py's parsed dict or the raw text (the RESP connection, REST)."""
    if isinstance(reply, Mapping):
        return reply
    fields: dict[str, str] = {}
    for line in str(reply).splitlines():
        name, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            fields[name.strip()] = value.strip()
    return fields


def durability_of(reply: Any) -> Durability:
    """What INFO (all its default sections) says. A field a service leaves out stays None."""
    info = info_fields(reply)
    aof = info.get("aof_enabled")
    policy = info.get("maxmemory_policy")
    evicted = info.get("evicted_keys")
    run_id, replid = info.get("run_id"), info.get("master_replid")
    server_id = f"{run_id}/{replid}" if run_id is not None and replid is not None else None
    replicas = info.get("connected_slaves")
    return Durability(None if aof is None else str(aof) == "1",
                      None if policy is None else str(policy),
                      None if evicted is None else int(evicted), server_id,
                      None if replicas is None else int(replicas))

