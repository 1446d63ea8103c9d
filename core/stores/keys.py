"""The ledger's key layout, shared by every store that speaks Redis.

Every key one call touches begins 'sc:{TAG}:' where TAG is the top scope of its budget path, so
all of them hash to one Redis Cluster slot. Keys that belong to no call (the ledger id, API keys,
live instances) stand alone, each in its own slot.
"""

from __future__ import annotations

LEDGER_ID_KEY = "sc:ledger"
INSTANCES_KEY = "sc:instances"


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
