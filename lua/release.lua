-- release: give back a reservation whose call provably never reached the provider.
--
-- KEYS[1] meta hash   KEYS[2] reservation hash   KEYS[3] open-lease zset
-- ARGV: ledger_id, now_ms or '', reservation_id, owner, record_retention_ms, run_idle_ms
-- Returns one of:
--   {'ok', released_micros, replayed 0|1}   {'not_found'}   {'settled'}   {'ledger_reset'}
-- Why: a release is a settle at zero that also says "nothing was billed". If expiry charged the
-- lease already, the release refunds that charge; releasing twice returns the first answer.
local now = ledger_now(ARGV[2])
local rid, owner = ARGV[3], ARGV[4]
local retention_ms = int(ARGV[5], 'record_retention_ms')
local idle_ms = int(ARGV[6], 'run_idle_ms')

if not ledger_matches(KEYS[1], ARGV[1]) then
  return {'ledger_reset'}
end
local prefix = prefix_of(KEYS[1])

local r = redis.call('HMGET', KEYS[2], 'st', 'owner', 'amt', 'legs', 'pol', 'rel')
if not r[1] or r[2] ~= owner then
  return {'not_found'}
end
if r[1] == 's' then
  return {'settled'}
end
if r[1] == 'r' then
  return {'ok', tonumber(r[6]), 1}
end

local amt = tonumber(r[3])
local released = amt
for _, leg in ipairs(parse_legs(r[4])) do
  local ck = counter_key(prefix, leg)
  if writable(ck, leg, now, idle_ms) then
    if r[1] == 'o' then
      hincr(ck, 'reserved', 0 - amt)
    elseif r[5] == 'charge' then
      hincr(ck, 'committed', 0 - amt)
    end
    touched(ck, leg, now, idle_ms)
  end
end
if r[1] == 'x' and r[5] ~= 'charge' then
  released = 0
end
redis.call('HSET', KEYS[2], 'st', 'r', 'rel', istr(released), 'outcome', 'released',
           'resolved_ms', istr(now))
redis.call('PEXPIRE', KEYS[2], istr(retention_ms))
redis.call('ZREM', KEYS[3], rid)
return {'ok', released, 0}
