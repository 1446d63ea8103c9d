-- settle: book the actual cost of a call in the periods its reservation held, not today's.
--
-- KEYS[1] meta hash   KEYS[2] reservation hash   KEYS[3] open-lease zset
-- ARGV: ledger_id, now_ms or '', reservation_id, owner, actual_micros, record_retention_ms,
--       run_idle_ms
-- Returns one of:
--   {'ok', charged_micros, released_micros, overshoot_micros, late 0|1, replayed 0|1}
--   {'not_found'}  {'conflict'} settled before at another actual  {'released'}
--   {'ledger_reset'}
-- Why: settle and expiry race for one winner. An open lease is settled here in one step. A lease
-- that expiry already resolved is corrected (lib: settle_one). Overshoot is what a settle
-- charged beyond what was held for it, so committed + reserved <= ceiling + overshoot holds for
-- every counter. Only the reservation's owner may settle it: a gateway call's owner is one no API
-- key can present (core/ledger.py GATEWAY_OWNER_PREFIX).
local now = ledger_now(ARGV[2])
local rid, owner = ARGV[3], ARGV[4]
int(ARGV[5], 'actual_micros')
local retention_ms = int(ARGV[6], 'record_retention_ms')
local idle_ms = int(ARGV[7], 'run_idle_ms')

if not ledger_matches(KEYS[1], ARGV[1]) then
  return {'ledger_reset'}
end
local prefix = prefix_of(KEYS[1])

local r = redis.call('HMGET', KEYS[2], 'st', 'owner', 'amt', 'legs', 'pol',
                     'act', 'charged', 'rel', 'over', 'late')
if not r[1] or r[2] ~= owner then
  return {'not_found'}
end
if r[1] == 's' then
  if r[6] ~= ARGV[5] then
    return {'conflict'}
  end
  return {'ok', tonumber(r[7]), tonumber(r[8]), tonumber(r[9]), tonumber(r[10]), 1}
end
if r[1] == 'r' then
  return {'released'}
end
return settle_one(prefix, KEYS[2], KEYS[3], rid, r[1], r[3], r[4], r[5], ARGV[5], now,
                  retention_ms, idle_ms, 'settled', {})
