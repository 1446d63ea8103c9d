-- reserve: hold the worst case of one call in every budget and period that applies, all or none.
--
-- KEYS[1] meta hash 'sc:{TAG}:meta'   KEYS[2] reservation 'sc:{TAG}:r:<id>'
-- KEYS[3] open-lease zset 'sc:{TAG}:open' (score: expires_at_ms)
-- ARGV: wire.py RESERVE_ARGS: ledger_id, reserved_micros, ttl_ms, budget_ids (the path, top
--   scope first, ' ' between), run (the run's budget id and ceiling, or ''), zones (lib:
--   zone_windows), expire_policy ('charge'|'release'), retention_ms (how long the record
--   answers repeats once resolved), owner, record_tail (fingerprint, price_version, model, kept
--   as they come), user (the call's end user, or ''), model (the priced model's one name, which
--   models.allow and per_model name; '' for an amount, UNLISTED_MODEL for a name no budget can
--   name), [now_ms].
-- Returns one of:
--   {'ok', now_ms, leg status..., seq}   the hold asked for, until now_ms + ttl_ms; seq the
--     tag's reserve sequence after it (meta 'seq', only grows)
--   {'replayed', reserved_micros, expires_at_ms, now_ms, leg status...}  the same reservation,
--     still open
--   {'resolved', state, outcome, reserved_micros, charged_micros}  a replay of a reservation
--     that is no longer open
--   {'exceeded'|'busy', now_ms, failing leg status}
--   {'conflict'} same id, other parameters   {'ledger_reset'}   {'no_budget'}
--   {'timezone', budget_id, timezone}   {'clock', now_ms}
--   {'paused', budget_id}  a velocity alarm paused a budget on the path
--   {'state_quota', 'records'|'runs', retry_after_s}  the key keeps all its quota allows of what
--     this hold would make it keep (core/limits.py RECORDS_PER_KEY_PER_WINDOW_MAX,
--     IDEMPOTENT_RECORDS_PER_KEY_MAX, RUNS_PER_KEY_MAX)
--   {'user_required', budget_id}  a budget on the path counts end users, and the call names none
--   {'model_not_allowed', budget_id}  a budget on the path allows only some models, and not the
--     call's
--   {'users_exhausted', budget_id}  the call's user would be one more than the budget's users_max
--   {'rate_limited'|'concurrency_limited', budget_id, retry_after_s}  a budget's (or its user's)
--     requests in the last minute, or its open reservations, are at its rate's limit
-- Why: the check and the hold must be one step, or concurrent calls all pass the same stale
-- check. Expired leases of this tag are reclaimed (a bounded batch) before a hold they might be
-- in the way of is refused, so a dead worker's hold does not block the budget past its lease,
-- and by a sample of reserves (core/limits.py RECLAIM_SAMPLE_DIGITS) so their charges are
-- booked while the tag sees calls. Replaying the same id returns the first answer
-- while the reservation is open (redis-py and the Upstash SDK both resend a script after a lost
-- reply), and what became of it once it is not: never a hold that is gone. The record is
-- written only if none is there (SET NX), which is how a replay is told apart: a fresh id costs
-- no read of its own.
local a = reserve_args(ARGV)
-- reserved_micros, ttl_ms and retention_ms are positive integers written without a leading
-- zero (one match for the three), below 2**53 (at most 16 digits, and compared).
if not string.find(a.reserved_micros .. ' ' .. a.ttl_ms .. ' ' .. a.retention_ms,
                   '^[1-9]%d* [1-9]%d* [1-9]%d*$')
    or #a.reserved_micros > 16 or #a.ttl_ms > 16 or #a.retention_ms > 15 then
  fail('BADARG', 'reserved_micros, ttl_ms, retention_ms')
end
local held, ttl = tonumber(a.reserved_micros), tonumber(a.ttl_ms)
if held > INT_MAX or ttl > INT_MAX then fail('BADARG', 'reserved_micros, ttl_ms') end
if a.expire_policy ~= 'charge' and a.expire_policy ~= 'release' then
  fail('BADARG', 'expire_policy')
end
local now = ledger_now(a.now_ms)
local now_text = istr(now)

local prefix = prefix_of(KEYS[1])
if a.user ~= '' and (#a.user > 128 or not string.find(a.user, '^[%w._:@-]+$')) then
  fail('BADARG', 'user')
end
local legs, status, paused = resolve_legs(prefix, a, now)
if status then
  if status[1] == 'user_required' or status[1] == 'model_not_allowed' then
    count_refusal(prefix, status[1])
  end
  return status
end
if paused then
  count_refusal(prefix, 'budget_paused')
  return {'paused', paused}  -- a velocity alarm paused it
end
if #legs == 0 then
  return {'no_budget'}
end

-- The common case: the hold fits, and this is not a reserve that looks for expired leases
-- first (RECLAIM_SAMPLE_DIGITS).
local looks = string.find(RECLAIM_SAMPLE_DIGITS, string.sub(KEYS[2], -1), 1, true)
local answer, failing, why
if not looks then
  answer, failing, why = hold(prefix, KEYS, legs, a, held, ttl, now, now_text)
  if answer then
    return answer
  end
end

-- The general case: expired leases to reclaim first (this reserve looks for them, or one may be
-- in the way of the hold), a budget that refuses, or a reservation already under this id.
if reclaim(prefix, KEYS[3], now, RECLAIM_BATCH_MAX) > 0 or looks then
  answer, failing, why = hold(prefix, KEYS, legs, a, held, ttl, now, now_text)
  if answer then
    return answer
  end
end
if why == 'quota' then
  count_refusal(prefix, 'state_quota')
  return failing  -- the key keeps all its quota allows: {'state_quota', kind, retry_after_s}
end
if why == 'limit' then
  count_refusal(prefix, failing[1])
  return failing  -- {'users_exhausted', budget_id} or {'rate_limited' | 'concurrency_limited',
                  -- budget_id, retry_after_s}
end
if failing and redis.call('EXISTS', KEYS[2]) == 0 then
  if why == 'exceeded' then
    alert_refused(prefix, failing, now)  -- budget.exceeded, once a window
  end
  count_refusal(prefix, why == 'exceeded' and 'budget_exceeded' or 'budget_busy')
  return {why, now, leg_status(failing, failing.committed, failing.reserved, failing.overshoot)}
end
-- A reservation already under this id: the first answer while it is open, else what became of
-- it; another call under the same id is a conflict.
local prior = load_record(KEYS[2])
if prior.fingerprint ~= string.match(a.record_tail, '^[^\t]*') or prior.owner ~= a.owner then
  return {'conflict'}
end
-- A lease past its end that no reclaim reached yet is expired here, by its own policy: a replay
-- must not answer as a hold the ledger is about to take back.
local lease_end = tonumber(prior.expires_at_ms)
if prior.state == 'open' and lease_end and lease_end <= now then
  expire_one(prefix, KEYS[3], id_of(prefix, KEYS[2]), now)
  prior = load_record(KEYS[2])
end
if prior.state ~= 'open' then
  return resolved_reply(prior)
end
local out = {'replayed', prior.reserved_micros, prior.expires_at_ms, now}
for _, leg in ipairs(parse_legs(prior.legs)) do
  out[#out + 1] = leg_status(leg, counters(counter_key(prefix, leg)))
end
return out
