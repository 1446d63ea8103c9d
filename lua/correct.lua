-- correct: an operator's settle of a reservation, whoever owns it, recorded on the reservation.
--
-- KEYS[1] meta hash   KEYS[2] reservation hash   KEYS[3] open-lease zset
-- ARGV: ledger_id, now_ms or '', reservation_id, actual_micros, corrected_by (a fingerprint of
--       the operator's credential), reason, record_retention_ms, run_idle_ms
-- Returns one of:
--   {'ok', charged_micros, released_micros, overshoot_micros, late 0|1, replayed 0|1,
--    corrected_from_micros}
--   {'resolved', state 's'|'r'|'x', outcome, amount_micros, charged_micros}
--   {'not_found'}   {'conflict'} corrected before to another actual   {'ledger_reset'}
-- Why: a call whose outcome is unknown (a gateway call that timed out, a stream that broke off)
-- stays held and is charged at expiry. Only an operator, who can read the provider's bill, may
-- lower that charge: no API key can settle a gateway reservation. A correction is allowed while
-- the reservation is open or after it expired as 'unknown'; it books like a settle (lib:
-- settle_one) and records by whom, when (the ledger's time), from what amount (the hold, which is
-- also what expiry charged) and why. Correcting twice with the same amount returns the first
-- answer.
local now = ledger_now(ARGV[2])
local rid = ARGV[3]
int(ARGV[4], 'actual_micros')
local by, reason = ARGV[5], ARGV[6]
local retention_ms = int(ARGV[7], 'record_retention_ms')
local idle_ms = int(ARGV[8], 'run_idle_ms')
if by == '' then fail('BADARG', 'corrected_by') end
if reason == '' then fail('BADARG', 'reason') end

if not ledger_matches(KEYS[1], ARGV[1]) then
  return {'ledger_reset'}
end
local prefix = prefix_of(KEYS[1])

local r = redis.call('HMGET', KEYS[2], 'st', 'amt', 'legs', 'pol', 'act', 'charged', 'rel',
                     'over', 'late', 'outcome', 'corrected_by')
if not r[1] then
  return {'not_found'}
end
if r[1] == 's' and r[11] then
  if r[5] ~= ARGV[4] then
    return {'conflict'}
  end
  return {'ok', tonumber(r[6]), tonumber(r[7]), tonumber(r[8]), tonumber(r[9]), 1, tonumber(r[2])}
end
if r[1] ~= 'o' and not (r[1] == 'x' and r[10] == 'unknown') then
  return {'resolved', r[1], r[10] or '', tonumber(r[2]), charged_of(r[1], r[10], r[2], r[6])}
end
local answer = settle_one(prefix, KEYS[2], KEYS[3], rid, r[1], r[2], r[3], r[4], ARGV[4], now,
                          retention_ms, idle_ms, 'corrected',
                          {'corrected_by', by, 'corrected_at_ms', istr(now),
                           'corrected_from_micros', r[2], 'correction_reason', reason})
answer[#answer + 1] = tonumber(r[2])
return answer
