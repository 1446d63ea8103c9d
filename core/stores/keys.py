"""The ledger's key layout, shared by every store that speaks Redis: every key is made here.

Every key one call touches begins 'sc:{TAG}:' where TAG is the top scope of its budget path, so
all of them hash to one Redis Cluster slot. The scripts build the keys of a call from its meta
key's prefix and the parts below (the prelude core/stores/wire.py generates hands them the same
parts). Keys that belong to no call (the ledger id, API keys, live instances, the tag map, a
model's output lengths) stand alone, each in its own slot.

What goes: everything a caller can make exist. Counters that hold spend carry no expiry, so a
Redis that evicts keys with one (volatile-*) never drops a budget's spend: a sweep deletes run
counters RUN_COUNTER_IDLE_MS after their last write and day, week and month counters (a
budget's and its users') COUNTER_RETENTION_MS after their window, by the tag's WINDOWS and RUNS
indexes (lua/lib.lua sweep_counters). What expires: reservation records (core/limits.py says how
long each kind is kept once resolved, and why), idempotency replies, quotas, output histograms,
probes and the live-instance set, and everything alerts write (the events, the outbox and the
log, hourly spend buckets, velocity slots and marks), a day's gateway spend per upstream and a
day's drift mark (DAILY_SPEND_RETENTION_MS after the day), and what a tag booked of a provider's
day unseen (DAILY_SPEND_RETENTION_MS after its last booking). What an operator made stays: the
ledger id and its format version, budget definitions and their total counters, API key records
(and a revoked key's record, which holds only when it was revoked: the id is never taken again),
a tag's refusal counts (a field per error code), the tag map, a tag's set of budget ids, a tag's
open-lease set while it has members (Redis drops an empty one), a budget's users sets (at most
its users_max members) and the registry of function libraries (as many as are kept).
"""

from __future__ import annotations

import hashlib

LEDGER_ID_KEY = "sc:ledger"
INSTANCES_KEY = "sc:instances"
# tag digest -> tag (core/ledger.py tag_digest), written when a budget is put: how an operator
# finds a reservation from its id alone. Read only by admin routes, never on a call's path.
TAG_MAP_KEY = "sc:tags"

# The ledger's catalogue, for operators (core/stores/operations.py), never read on a call's path.
# Each is in the slot of LEDGER_ID_KEY: '{sc:ledger}' hashes as 'sc:ledger' does. A Redis Cluster
# shard that loses them has lost the ledger id with them, which every instance already reads as
# a reset; a shard that loses only some organisations leaves their entry in ORGS_KEY, which is
# how their loss reads as `ledger_reset` instead of "no budget".
CATALOGUE = "{sc:ledger}:"
ORGS_KEY = CATALOGUE + "orgs"  # hash: tag -> the ledger id its budgets were put under
BUDGETS_KEY = CATALOGUE + "budgets"  # sorted set, score 0: budget ids, in byte order
KEYS_KEY = CATALOGUE + "keys"  # sorted set, score 0: '<budget id> <key id>', in byte order
AUDIT_KEY = CATALOGUE + "audit"  # stream: every admin change (core/operations.py)
# The ledger id a restore stamped, and the one an operator confirmed (`ceiling ledger adopt`):
# instances that found their ledger reset take the new id when both name it.
RESTORED_KEY = CATALOGUE + "restored"
ADOPTED_KEY = CATALOGUE + "adopted"
# A rollback an instance found (a tag's sequence went back: core/stores/scripted_core.py), and the
# one an operator last adopted (`ceiling ledger adopt`): the fleet refuses to enforce while the
# two differ. Each holds a token, 'found_at_ms tag sequence floor'.
ROLLED_BACK_KEY = CATALOGUE + "rolled_back"
ROLLBACK_ADOPTED_KEY = CATALOGUE + "rollback_adopted"
# The format version of the ledger (core/stores/wire.py LEDGER_FORMAT_VERSION), written when the
# ledger id is made: in the id's slot, so the two go together.
LEDGER_FORMAT_KEY = CATALOGUE + "format"
# The function libraries versions of the code loaded here, a sorted set of library names by when
# an instance of each first opened the ledger: which of them to keep (core/stores/scripts.py
# prune_libraries). As many members as libraries that rule keeps.
LIBRARIES_KEY = CATALOGUE + "libraries"

# The parts after 'sc:{TAG}:' of the keys of one tag.
META = "meta"
RECORD = "r:"  # + reservation id: one reservation, a string (wire.py RECORD_FIELDS)
OPEN = "open"  # the open leases, a sorted set of reservation ids by lease end
DEFINITION = "def:"  # + budget id: one budget's limits
COUNTER = "p:"  # + budget id '|' window key: one budget's counters in one period window
# Counters that hold spend carry no expiry, so an evicting Redis (volatile-*) finds none to drop;
# these list them for the sweep that deletes them instead (lua/lib.lua sweep_counters), each a
# sorted set of counter keys after 'sc:{TAG}:', one member per counter, kept without an expiry:
WINDOWS = "windows"  # day, week and month counters, by when each may go
RUNS = "runs"  # run counters, by their last write
REPLY = "reply:"  # + digest: one idempotency key of one API key (core/replies.py)
# + owner (an API key id, or 'gw:' and one): what that key made and keeps in the current quota
# window (core/limits.py STATE_QUOTA_WINDOW_MS), a hash: 'window' (its index), 'records', 'runs',
# 'replies', 'reply_bytes'. Expires two windows after its own.
QUOTA = "q:"
# + budget id: the end users of a budget with per_user limits that a call of theirs was charged
# in, a sorted set (score 0, so in byte order, pages by ZRANGEBYLEX). Kept as long as the budget,
# as a user's total counter is (a user's total never refills).
USERS = "u:"
# + budget id: the end users with a call open and none charged yet, a sorted set (score 0, byte
# order) that a user leaves when a call of theirs is charged (for USERS) or when their calls have
# all ended uncharged (released, settled at zero, expired under 'release'). With USERS, at most
# the budget's users_max ids.
PENDING_USERS = "uo:"
# + budget id (a user's too): the reservation ids of its calls in the last RATE_WINDOW_MS, a
# sorted set by when each was admitted; expires a window after its last call.
RATE = "rl:"
# + budget id (a user's too): its open reservations' ids by lease end, a sorted set, at most its
# concurrent_max; Redis drops it when its last member goes, and a member past its lease end is
# trimmed by the next reserve that reads it.
CONCURRENCY = "cc:"
# Model names are free text: the key of a model's output lengths holds a digest of one, so no
# name can shape a key. 96 bits: two models of the millions a deployment could see share one
# histogram with a chance below one in 10**16, and sharing one costs a p95 nothing money needs.
MODEL_DIGEST_HEX = 24


def prefix(tag: str) -> str:
    return f"sc:{{{tag}}}:"


def meta(tag: str) -> str:
    return prefix(tag) + META


def reservation(tag: str, reservation_id: str) -> str:
    return prefix(tag) + RECORD + reservation_id


def open_leases(tag: str) -> str:
    return prefix(tag) + OPEN


def definition(tag: str, budget_id: str) -> str:
    return prefix(tag) + DEFINITION + budget_id


def counter(tag: str, budget_id: str, window_key: str) -> str:
    return f"{prefix(tag)}{COUNTER}{budget_id}|{window_key}"


def reply(tag: str, digest: str) -> str:
    return prefix(tag) + REPLY + digest


def quota(tag: str, owner: str) -> str:
    return prefix(tag) + QUOTA + owner


def output_lengths(model: str) -> str:
    """A model's output-length histogram (core/output_stats.py); names differing in case are
    one model."""
    digest = hashlib.sha256(model.lower().encode()).hexdigest()[:MODEL_DIGEST_HEX]
    return "sc:{out:" + digest + "}"


def api_key_record(key_id: str) -> str:
    """An API key: the one record under its id that says which secrets it takes (the current
    one's hash, the previous one's and when that one's grace ends), its budget, run ceiling,
    roles and times; a revoked key's record keeps only when it was revoked. The id is its hash
    tag, so each script on a key (lua/key_*.lua) touches one slot. Secrets carry their key id
    (core/service.py new_api_key), so nothing else needs to be in that slot."""
    return f"sc:key:{{{key_id}}}"


def api_key(key_hash: str) -> str:
    """Under a secret's hash: the id of the key whose record decides whether the secret is taken
    (field 'key_id'), for a secret that does not carry its key id (one minted before secrets
    did). Secrets minted since carry it and have no entry here."""
    return f"sc:key:{key_hash}"


def probe(instance_id: str) -> str:
    return f"sc:probe:{instance_id}"


# -- alerts: every key below expires (core/limits.py says when) ----------------------
ALERT = "ev:"  # + event id: one alert event, a hash (its fields: core/alerts.py EVENT_FIELDS)
OUTBOX = "outbox"  # events to deliver, a sorted set of event ids by next attempt
ALERT_LOG = "alerts"  # every event of the tag, a sorted set of event ids by when it happened
SPEND = "h:"  # + budget id '|' hour index: a budget's committed spend booked in one hour
VELOCITY = "v:"  # + budget id '|' slot index: spend in one slot of a velocity window
VELOCITY_MARK = "vm:"  # + budget id '|' window index: the window's velocity alarm went out
# The meta hash field listing the tag's budgets with a velocity alarm, read by every settle.
VELOCITY_FIELD = "alert_velocity"
# + upstream '|' UTC day index (days since 1970-01-01): the committed spend gateway calls to that
# upstream booked at their settle, by the day they started, a string (core/ledger.py
# Reconciliation). Expires DAILY_SPEND_RETENTION_MS after its day.
DAILY_SPEND = "gw:"
# The refusals the tag's reserves decided, a hash: error code -> count. As many fields as codes.
REFUSED = "refused"
# The tag of events about the ledger as a whole (a 'ledger.drift'), which no budget's tag can be:
# a budget's top scope always holds ':'.
LEDGER_EVENTS_TAG = "ledger"
# + provider '|' day (YYYY-MM-DD): that day's drift was reported (lua/drift_alert.lua); kept as
# long as a day's spend is.
DRIFT_MARK = "drift:"
# + provider '|' day (YYYY-MM-DD): what a provider billed that day beyond what the ledger saw that
# is booked into a budget of this tag so far, micro-dollars (lua/book_unseen.lua); kept as long as
# a day's spend is, from its last write.
UNSEEN_BOOKED = "unseen:"
# + provider: the lease one reconcile run holds while it books that provider's unseen spend into
# any organisation (core/reconcile.py BOOKING_LEASE_MS), a string (its holder's token). One fixed
# key for the whole ledger, so that runs into budgets of two organisations book a day once.
BOOKING_LEASE_KEY = CATALOGUE + "book_lease:"
# + tag '|' provider '|' day (YYYY-MM-DD): the booked total of that tag's mark (UNSEEN_BOOKED) the
# audit stream has an entry for (lua/audit_booked.lua); kept as long as the mark.
UNSEEN_AUDITED_KEY = CATALOGUE + "unseen_audited:"


def booking_lease(provider: str) -> str:
    return BOOKING_LEASE_KEY + provider


def unseen_audited(tag: str, provider: str, day: str) -> str:
    return f"{UNSEEN_AUDITED_KEY}{tag}|{provider}|{day}"


def alert(tag: str, event_id: str) -> str:
    return prefix(tag) + ALERT + event_id


def outbox(tag: str) -> str:
    return prefix(tag) + OUTBOX


def alert_log(tag: str) -> str:
    return prefix(tag) + ALERT_LOG


def spend(tag: str, budget_id: str, hour_index: int) -> str:
    return f"{prefix(tag)}{SPEND}{budget_id}|{hour_index}"


def daily_spend(tag: str, upstream: str, day_index: int) -> str:
    return f"{prefix(tag)}{DAILY_SPEND}{upstream}|{day_index}"


def unseen_booked(tag: str, provider: str, day: str) -> str:
    return f"{prefix(tag)}{UNSEEN_BOOKED}{provider}|{day}"


def refused(tag: str) -> str:
    return prefix(tag) + REFUSED
