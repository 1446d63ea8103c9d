-- expire: resolve leases of one tag whose time is up, a bounded batch per call.
--
-- KEYS[1] meta hash   KEYS[2] open-lease zset
-- ARGV: ledger_id, now_ms or '', batch_max, record_retention_ms, run_idle_ms
-- Returns {'ok', expired_count, open_left} or {'ledger_reset'}.
-- Why: reserve reclaims expired leases of its own tag before it checks, so a budget is never
-- blocked by a dead worker's hold; this script lets a sweeper do the same for tags that see no
-- new calls, so their spend is booked. Each lease is resolved by its stored policy.
local now = ledger_now(ARGV[2])
local batch_max = int(ARGV[3], 'batch_max')
local retention_ms = int(ARGV[4], 'record_retention_ms')
local idle_ms = int(ARGV[5], 'run_idle_ms')
if not ledger_matches(KEYS[1], ARGV[1]) then
  return {'ledger_reset'}
end
local n = reclaim(prefix_of(KEYS[1]), KEYS[2], now, batch_max, retention_ms, idle_ms)
return {'ok', n, redis.call('ZCARD', KEYS[2])}
