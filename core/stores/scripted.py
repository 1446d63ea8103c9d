"""ScriptedStore: the LedgerStore of every backend that runs the lua/ scripts.

The domain side (arguments, replies, ledger identity, time zones, probe) lives here once, with
the Lua boundary's names in core/stores/wire.py; a Transport (redis-py, redis-py cluster, the
Upstash REST SDK) only carries commands and translates its client's exceptions into the core
error tree.

ScriptedStore is one class per protocol of core/ledger.py, combined: scripted_core.py
(ScriptedCore: the transport, identity and time, windows, durability, probe),
scripted_ledger.py (reservations), scripted_catalogue.py (budgets), scripted_keys.py (API keys),
scripted_reports.py (output lengths, alerts, reconciliation), scripted_replies.py (replies).
"""

from __future__ import annotations

from core.stores.scripted_catalogue import ScriptedCatalogue
from core.stores.scripted_core import Acknowledging, Clock, ScriptedCore, Transport
from core.stores.scripted_keys import ScriptedKeys
from core.stores.scripted_ledger import ScriptedLedger
from core.stores.scripted_replies import ScriptedReplies
from core.stores.scripted_reports import ScriptedReports

__all__ = ["Acknowledging", "Clock", "ScriptedCore", "ScriptedReplies", "ScriptedStore",
           "Transport"]


class ScriptedStore(ScriptedLedger, ScriptedCatalogue, ScriptedKeys, ScriptedReports):
    """A shared ledger on a Redis-speaking backend. See core.ledger.LedgerStore."""
