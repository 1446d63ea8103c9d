-- expire: resolve leases of one tag whose time is up, a bounded batch per call.
--
-- KEYS[1] meta hash   KEYS[2] open-lease zset
-- ARGV: wire.py EXPIRE_ARGS: ledger_id, batch_max, [now_ms]
-- Returns {'ok', expired_count, open_left} or {'ledger_reset'}.
-- Why: reserve reclaims expired leases of its own tag before it checks, so a budget is never
-- blocked by a dead worker's hold; this script lets a sweeper do the same for tags that see no
-- new calls, so their spend is booked. Each lease is resolved by its stored policy. It sweeps the
-- tag's counters whose time has come too (lib: sweep_counters), as a hold that opens one does.
local a = expire_args(ARGV)
local batch_max = int(a.batch_max, 'batch_max')
local now = ledger_now(a.now_ms)
if not ledger_matches(KEYS[1], a.ledger_id) then
  return {'ledger_reset'}
end
local prefix = prefix_of(KEYS[1])
local n = reclaim(prefix, KEYS[2], now, batch_max)
sweep_counters(prefix, now)  -- counters whose time has come, in a tag that may see no calls
return {'ok', n, redis.call('ZCARD', KEYS[2])}
