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
# Expired leases resolved by one expire call of a sweeper (an operator's, the reliability tests').
SWEEP_BATCH_MAX = 500
# Resolved reservations are kept a week so that replays and late settles find their answer. An
# open one is kept that long past the end of its lease: expiry (the next reserve of its tag, or a
# sweeper) resolves it long before, and a record nothing resolves in a week still goes away.
RECORD_RETENTION_MS = 7 * 24 * 3_600_000
# A run's counter is dropped after a day with no write to it (a reserve, settle, release or expiry
# of one of its calls): agent runs last minutes to hours, and run ids come from callers, so
# without an end each one would be kept for ever. A day is far longer than any lease
# (RESERVATION_TTL_MS_MAX), and every write starts the day again, so a counter never goes while a
# reservation of its run is open. A run id used again after a silent day is a new run; the
# budgets above it still bound what it spends.
RUN_COUNTER_IDLE_MS = 24 * 3_600_000
# Day and month counters are kept 400 days after their window ends, for reports and late settles.
COUNTER_RETENTION_MS = 400 * 24 * 3_600_000

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
