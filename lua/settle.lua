-- settle: book the actual cost of a call in the periods its reservation held, not today's.
--
-- KEYS[1] meta hash   KEYS[2] reservation hash   KEYS[3] open-lease zset
-- ARGV: ledger_id, now_ms or '', reservation_id, owner, actual_micros, record_retention_ms
-- Returns one of:
--   {'ok', charged_micros, released_micros, overshoot_micros, late 0|1, replayed 0|1}
--   {'not_found'}  {'conflict'} settled before at another actual  {'released'}
--   {'ledger_reset'}
-- Why: settle and expiry race for one winner. An open lease is settled here in one step. A lease
-- that expiry already resolved is corrected: under the 'charge' policy its reserved amount sits
-- in committed and is swapped for the actual; under 'release' nothing is held, so the whole
-- actual is charged and counted as overshoot. Overshoot is what a settle charged beyond what was
-- held for it, so committed + reserved <= ceiling + overshoot holds for every counter.
local now = ledger_now(ARGV[2])
local rid, owner = ARGV[3], ARGV[4]
local actual = int(ARGV[5], 'actual_micros')
local retention_ms = int(ARGV[6], 'record_retention_ms')

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

local amt = tonumber(r[3])
local held, committed_delta, reserved_delta, late = amt, actual, 0 - amt, 0
if r[1] == 'x' then
  late = 1
  reserved_delta = 0
  if r[5] == 'charge' then
    committed_delta = actual - amt
  else
    held = 0
  end
end
local overshoot = math.max(0, actual - held)
local released = math.max(0, held - actual)
for _, leg in ipairs(parse_legs(r[4])) do
  local ck = counter_key(prefix, leg)
  hincr(ck, 'reserved', reserved_delta)
  hincr(ck, 'committed', committed_delta)
  hincr(ck, 'overshoot', overshoot)
end
redis.call('HSET', KEYS[2], 'st', 's', 'act', ARGV[5], 'charged', ARGV[5],
           'rel', istr(released), 'over', istr(overshoot), 'late', istr(late),
           'outcome', 'settled', 'resolved_ms', istr(now))
redis.call('PEXPIRE', KEYS[2], istr(retention_ms))
redis.call('ZREM', KEYS[3], rid)
return {'ok', actual, released, overshoot, late, 0}
