-- settle: book the actual cost of a call in the periods its reservation held, not today's.
--
-- KEYS[1] meta hash   KEYS[2] reservation   KEYS[3] open-lease zset
-- ARGV: wire.py SETTLE_ARGS: owner, actual_micros, upstream (a gateway call's bill, or ''),
--   [now_ms]
-- Returns one of:
--   {'ok', state, expire_policy, reserved_micros}  what it settled: the caller works out what
--     was booked from them by core/lifecycle.py's table, by which it was booked here
--   {'replayed', charged_micros, released_micros, overshoot_micros, late 0|1}  settled before
--   {'not_found'}  {'conflict'} settled before at another actual  {'released'}
-- Alerts: each leg's committed spend, as HINCRBY returns it, goes to lib's
-- committed_moved, which emits a threshold event only on a crossing and keeps the hourly bucket.
-- What it charges, or corrects, counts in the day of the reservation's bill (lib: count_day):
-- the record's `bill`, else (a record kept before it had one) `upstream`.
-- Why: settle and expiry race for one winner. An open lease is settled here in one step. A lease
-- that expiry already resolved is corrected (lib: resolve, by the lifecycle's table). Overshoot
-- is what a settle charged beyond what was held for it, so committed + reserved <= ceiling +
-- overshoot holds for every counter. Only the reservation's owner may settle it: a gateway
-- call's owner is one no API key can present (core/ledger.py GATEWAY_OWNER_PREFIX). No ledger
-- check: the record is the ledger's own, under an id of 128 random bits (or a digest of its
-- owner and Idempotency-Key); a wiped ledger has none, and the caller, told 'not_found', asks
-- whether the ledger's identity is lost.
local a = settle_args(ARGV)
local actual = int(a.actual_micros, 'actual_micros')
local now = a.now_ms and ledger_now(a.now_ms)
local prefix = prefix_of(KEYS[1])
if a.upstream ~= '' and not UPSTREAMS[a.upstream] then
  fail('BADARG', 'upstream')
end

-- The common case, an open gateway call resolved by its owner, is answered at once; the general
-- case is a record kept whole, or one settled or released before (lib: resolve_or_load).
local answer, rec, created_ms
answer, rec, now, created_ms = resolve_or_load(prefix, KEYS, a.owner, settle_effects, actual,
                                               a.actual_micros, now)
if answer then
  -- The common case is a gateway call's, whose settle names the bill its reserve recorded.
  if created_ms then
    count_day(prefix, a.upstream, created_ms, actual)
  end
  return answer
end
if rec.state == 'settled' then
  if tonumber(rec.actual_micros) ~= actual then
    return {'conflict'}
  end
  return settled_reply(rec)
end
if rec.state == 'released' then
  return {'released'}
end
local state, policy = rec.state, rec.expire_policy
resolve(prefix, KEYS[2], KEYS[3], rec, 'settle', actual, now, nil, a.upstream)
return {'ok', state, policy, rec.reserved_micros}
