"""Named limits, each with the reason it has the value it has."""

# Lua numbers are doubles: integers are exact only below 2**53, and every amount passes through Lua.
INT_EXACT_MAX = 2**53 - 1
# $1,000,000 for one call or one settle: far below 2**53, far above any real call.
AMOUNT_MICROS_MAX = 10**12
# $1,000,000,000 for one limit: sums of many settles must stay below 2**53 as well.
CEILING_MICROS_MAX = 10**15
# Token counts beyond any context window; keeps tokens x rate far below 2**53.
TOKENS_MAX = 100_000_000
# Choices (`n`) of one call; OpenAI caps n at 128.
CHOICES_MAX = 128

# A lease shorter than a second expires before a normal call returns.
RESERVATION_TTL_MS_MIN = 1_000
# A lease is held at most 15 minutes: the longest call we admit must settle within it.
RESERVATION_TTL_MS_MAX = 15 * 60_000
# Default lease: above the default upstream timeout (10 minutes), so a slow call is not expired.
RESERVATION_TTL_MS_DEFAULT = 11 * 60_000

# Expired leases reclaimed by one reserve: bounds the work (and latency) one call can inherit.
RECLAIM_BATCH_MAX = 16
# A reserve looks for its tag's expired leases only when one of them could be in its way (it
# would be refused), and otherwise when its id ends in one of these hex digits, one reserve in
# 16 (by the id, so a resend of a reserve does as its first run did): admission is the same as
# reclaiming on every reserve, a reserve that fits saves a read, and a tag that sees calls books
# its expired leases' charges within some 16 of them. With RECLAIM_BATCH_MAX that reclaims up to
# one expired lease per reserve, more than calls die.
RECLAIM_SAMPLE_DIGITS = "0"
# Expired leases resolved by one expire call of a sweeper (an operator's, the reliability tests').
SWEEP_BATCH_MAX = 500
# How long a resolved reservation is kept is what can still need it, and nothing longer:
# - A gateway call's reservation is settled or released by the gateway alone, once; the only
#   repeat is a resend of the same script after a lost reply, which redis-py and the Upstash SDK
#   make within one ledger call's time bound (LEDGER_CALL_TIMEOUT_S, UPSTASH_CALL_TIMEOUT_S, two
#   seconds each). Its record answers resends for this long, with room for a slow server.
RESEND_WINDOW_MS = 10_000
# - A caller that named its call by an Idempotency-Key (a sidecar's reserve, a gateway call) may
#   replay the reserve under it (the replay says what became of it) while the key means the same
#   call; the gateway keeps the answers of such calls as long. The id is the key's digest, so
#   the record is what tells a replay from a new call: it is kept this long once resolved. A
#   day: SDK retries come within minutes, and an agent that resumes a run the next morning
#   should make new calls.
IDEMPOTENCY_WINDOW_MS = 24 * 3_600_000
# - A lease that expired under 'charge' has an unknown outcome: the worker may have been billed,
#   and only an operator who reads the provider's bill may lower the charge. Its record
#   is kept until that bill can be read: the provider's invoice covers a calendar month and
#   arrives days after it ends. Corrections, the operators' own audit trail, are kept as long. A
#   late settle of such a lease (a call that outlived its lease) finds it in that time too.
UNKNOWN_OUTCOME_RETENTION_MS = 35 * 24 * 3_600_000
# - An open reservation is resolved by expiry (the next reserve of its tag, or a sweeper) soon
#   after its lease; one that nothing resolves is an unknown outcome, and goes
#   UNKNOWN_OUTCOME_RETENTION_MS after its lease.
# A run's counter is dropped after a day with no write to it (a reserve, settle, release or expiry
# of one of its calls): agent runs last minutes to hours, and run ids come from callers, so
# without an end each one would be kept for ever. A day is far longer than any lease
# (RESERVATION_TTL_MS_MAX), and every write starts the day again, so a counter never goes while a
# reservation of its run is open. A run id used again after a silent day is a new run; the
# budgets above it still bound what it spends.
RUN_COUNTER_IDLE_MS = 24 * 3_600_000
# - A sidecar reservation under an id the ledger minted (no Idempotency-Key) can be repeated only
#   by its caller's retry queue resending a settle or release (or a resend of the script): it
#   is kept this long once resolved, money moved or not, as is a reservation under an
#   Idempotency-Key that moved no money (released, settled at zero, expired under 'release'):
#   long enough for a retry queue after an outage of minutes, short enough that what a key
#   keeps is its call rate times minutes, not its calls of a day. A settle or release resent
#   later finds no record: 404 reservation_not_found, and no money moves (a minted id is never
#   made again, so nothing can be held or charged under it twice).
REPLAY_WINDOW_MS = 10 * 60_000
# What one API key may keep, counted in the same script that makes the state, per fixed window
# (what a key made in the last windows its state can live through can still be kept). Past one:
# 429 state_quota until the window ends.
# - Reservations kept past a resend, by the window they are kept for once resolved: a key that
#   keeps its calls' records for minutes keeps what its call rate makes in minutes. Derived from
#   a rate, ten times the busiest honest key we know of (10 calls a second all day, one service's
#   sidecar), so that no honest key meets it; a key faster than this is a fleet, which should
#   hold a key per instance or service, so that one leaked key cannot fill the ledger. A record
#   lives at most its lease (RESERVATION_TTL_MS_MAX) and REPLAY_WINDOW_MS after it is made, so
#   at most four windows' records live at once (docs/guarantees.md: the bytes).
RECORDS_PER_KEY_PER_S_MAX = 100
RECORDS_QUOTA_WINDOW_MS = REPLAY_WINDOW_MS
RECORDS_PER_KEY_PER_WINDOW_MAX = RECORDS_PER_KEY_PER_S_MAX * RECORDS_QUOTA_WINDOW_MS // 1_000
# The window of the quotas below: as long as the longest any of them is kept idle (a key keeps
# at most twice each).
STATE_QUOTA_WINDOW_MS = IDEMPOTENCY_WINDOW_MS
# - Reservations under an Idempotency-Key that moved money, kept the idempotency window (a day)
#   so a replay finds them: ~200 bytes each. The price of a day's replays; a busy key that needs
#   more names its calls by the ids the ledger mints (kept minutes, above).
IDEMPOTENT_RECORDS_PER_KEY_MAX = 100_000
# - Runs (X-Ceiling-Run-Id) a key opens: each run's counter is kept a day after its last call.
#   Agent runs take minutes to hours; a key that opens more than this a day is minting run ids.
RUNS_PER_KEY_MAX = 10_000
# - Idempotency keys a key claims (each is kept the idempotency window with its answer).
REPLIES_PER_KEY_MAX = 10_000
# - Bytes of answers kept for idempotent retries, compressed: past it an answer is not kept, and
#   a retry is told what became of the call (409 reply_not_kept), never called again.
REPLY_BYTES_PER_KEY_MAX = 4 * 1024 * 1024
# Day and month counters are kept 400 days after their window ends, for reports and late settles.
COUNTER_RETENTION_MS = 400 * 24 * 3_600_000
# Counters that hold spend carry no expiry (an evicting Redis must find none to drop); a sweep
# deletes those whose time has come (COUNTER_RETENTION_MS, RUN_COUNTER_IDLE_MS), at most this
# many of each kind a time. It runs whenever a hold opens a new counter, so a tag deletes up to
# this many for each one it makes: more than ever come due.
COUNTER_SWEEP_BATCH_MAX = 16

# Scopes in one budget path: org/team/project/key/... deeper trees are a modelling error.
SCOPES_MAX = 8
# Characters of one budget id; it is part of every Redis key of the call.
BUDGET_ID_LEN_MAX = 256
# Characters of a reservation id or idempotency key.
RESERVATION_ID_LEN_MAX = 128
# Characters of an operator's reason for a correction: a sentence or a ticket reference.
CORRECTION_REASON_LEN_MAX = 500
# Retries of a script whose period windows or time zone the caller guessed wrong: one is enough
# (the script returns the right values); a second covers a period boundary passing in between.
WINDOW_RETRIES_MAX = 2
# Budget time zones remembered per process, so a reserve needs one round trip.
TZ_CACHE_MAX = 10_000

# -- end users and rates -----------------------------------------------------------------------
# End users one budget may hold when its definition gives no users_max: the state a key can make
# of one budget's users (their counters) is bounded by it.
USERS_MAX_DEFAULT = 10_000
# The most end users one budget may be given: deleting the budget deletes each user's counters
# in one script, which stays short at this many.
USERS_MAX_MAX = 100_000
# Models one budget may limit each (per_model): a reserve finds the call's model among them by one
# plain search of the definition's per_model field, and a budget's status shows up to four legs
# per model; at this many, both stay as cheap as a budget's own. Deleting the budget keeps its
# models' counters, as it keeps its own (lua/delete_budget.lua says why).
PER_MODEL_MAX = 32
# A model's name as a call or a definition gives it: the longest the price table looks up
# (genai-prices' and providers' names are far shorter; a caller's name is bounded before any
# lookup or cache holds it).
MODEL_NAME_LEN_MAX = 200
# A model's one name as a budget names it and the ledger matches it (core/budgets.py
# is_model_name, lua/lib.lua check_model): every priced name is far shorter, and a per_model
# counter's budget id, which holds it, stays a short key.
MODEL_ONE_NAME_LEN_MAX = 128
# Models one budget's allow-list may name: a reserve of a budget with one searches the list (one
# plain search of a string of up to this many names) on every call.
MODELS_ALLOW_MAX = 256
# A rate is counted in a log of each admitted call's time, a sorted set of up to this many
# members per budget (and per end user): within what one Redis key holds cheaply.
REQUESTS_PER_MINUTE_MAX = 100_000
RATE_WINDOW_MS = 60_000
CONCURRENT_MAX_MAX = 100_000
# A concurrency limit frees up when an open call ends: a settle or release ends it at once, and
# expiry at its lease end at the latest. A refusal's Retry-After is the earliest lease end among
# the held slots (rounded up), the moment a slot is free for certain, never less than this: a
# call that settles sooner frees its slot sooner, and a client may ask again then.
CONCURRENCY_RETRY_AFTER_S_MIN = 1

# -- alerts --------------------------------------------------------------------------------------
# Thresholds one budget may alert at: a handful says "half, most, all"; more is noise.
ALERT_THRESHOLDS_MAX = 10
# An alert event is kept this long after it happened or was last delivered: the alert log on the
# page and GET /v1/admin/alerts reach back a month, the span of the longest period a budget has.
ALERT_RETENTION_MS = 35 * 24 * 3_600_000
# Spend is kept per budget in hourly buckets (the page's chart, GET /v1/usage/me, the trailing
# hourly rate of a velocity alarm), each kept as long as the alert log reaches back.
SPEND_BUCKET_MS = 3_600_000
SPEND_BUCKET_RETENTION_MS = ALERT_RETENTION_MS
# The length of a UTC day, for the day index of a day's spend (no leap seconds in Unix time).
DAY_MS = 24 * 3_600_000
# A day's gateway spend per upstream is kept this many days after the day, and a reconciliation
# reads at most this many days at once: providers' cost reports reach back about a year.
DAILY_SPEND_DAYS_MAX = 400
DAILY_SPEND_RETENTION_MS = DAILY_SPEND_DAYS_MAX * DAY_MS
# A velocity window is counted in this many slots: the "sliding" window moves a tenth of its
# length at a time, near enough for an alarm, and a check reads ten keys.
VELOCITY_SLOTS = 10
# Velocity windows from a minute (shorter is noise between two calls) to a day (longer is what
# a day ceiling is for).
VELOCITY_WINDOW_S_MIN = 60
VELOCITY_WINDOW_S_MAX = 86_400
# A velocity alarm's rate multiple, in thousandths in the ledger (integers only in Lua): from
# 1.001x to 1,000,000x the trailing hourly rate.
VELOCITY_MULTIPLE_MILLI_MAX = 10**9
# The trailing hourly rate is the budget's spend over this many whole hours before this one.
VELOCITY_TRAILING_HOURS = 24
