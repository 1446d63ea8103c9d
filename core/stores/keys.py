"""The ledger's key layout, shared by every store that speaks Redis.

Every key one call touches begins 'sc:{TAG}:' where TAG is the top scope of its budget path, so
all of them hash to one Redis Cluster slot. Keys that belong to no call (the ledger id, API keys,
live instances, the tag map) stand alone, each in its own slot.

What expires: everything a caller can make exist. Reservation records (a week after they are
resolved, or after their lease ends), run counters (RUN_COUNTER_IDLE_MS after their last write),
day and month counters (COUNTER_RETENTION_MS after their window), idempotency replies, output
histograms, probes and the live-instance set. What an operator made stays: the ledger id, budget
definitions and their total counters, API key records, the tag map, and a tag's open-lease set
while it has members (Redis drops an empty one).
"""

from __future__ import annotations

LEDGER_ID_KEY = "sc:ledger"
INSTANCES_KEY = "sc:instances"
# tag digest -> tag (core/ledger.py tag_digest), written when a budget is put: how an operator
# finds a reservation from its id alone. Read only by admin routes, never on a call's path.
TAG_MAP_KEY = "sc:tags"


def meta(tag: str) -> str:
    return f"sc:{{{tag}}}:meta"


def reservation(tag: str, reservation_id: str) -> str:
    return f"sc:{{{tag}}}:r:{reservation_id}"


def open_leases(tag: str) -> str:
    return f"sc:{{{tag}}}:open"


def definition(tag: str, budget_id: str) -> str:
    return f"sc:{{{tag}}}:def:{budget_id}"


def api_key(key_hash: str) -> str:
    return f"sc:key:{key_hash}"


def api_key_id(key_id: str) -> str:
    return f"sc:keyid:{key_id}"


def probe(instance_id: str) -> str:
    return f"sc:probe:{instance_id}"
