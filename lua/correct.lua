-- correct: an operator's settle of a reservation, whoever owns it, recorded on the reservation.
--
-- KEYS[1] meta hash   KEYS[2] reservation   KEYS[3] open-lease zset
-- ARGV: wire.py CORRECT_ARGS: actual_micros, corrected_by (a fingerprint of the operator's
--   credential), correction_reason (escaped free text), [now_ms]
-- Returns one of:
--   {'ok', state, expire_policy, reserved_micros}  what it corrected (as settle.lua answers)
--   {'replayed', charged_micros, released_micros, overshoot_micros, late 0|1}
--   {'resolved', state, outcome, reserved_micros, charged_micros}
--   {'not_found'}   {'conflict'} corrected before to another actual
-- Why: a call whose outcome is unknown (a gateway call that timed out, a stream that broke off)
-- stays held and is charged at expiry. Only an operator, who can read the provider's bill, may
-- lower that charge: no API key can settle a gateway reservation. The lifecycle's table allows a
-- correction while the reservation is open or after it expired as 'unknown'; it books like a
-- settle (lib: resolve) and records by whom, when (the ledger's time), from what amount (the
-- hold, which is also what expiry charged) and why. Correcting twice with the same amount
-- returns the first answer. No ledger check, as in settle.lua.
local a = correct_args(ARGV)
local actual = int(a.actual_micros, 'actual_micros')
if a.corrected_by == '' then fail('BADARG', 'corrected_by') end
if a.correction_reason == '' then fail('BADARG', 'correction_reason') end
local now = ledger_now(a.now_ms)

local rec = load_record(KEYS[2])
if not rec then
  return {'not_found'}
end
if rec.state == 'settled' and rec.corrected_by ~= '' then
  if tonumber(rec.actual_micros) ~= actual then
    return {'conflict'}
  end
  return settled_reply(rec)
end
if not effects('correct', rec.state, rec.expire_policy, 0, 0) then
  return resolved_reply(rec)
end
local state, policy = rec.state, rec.expire_policy
resolve(prefix_of(KEYS[1]), KEYS[2], KEYS[3], rec, 'correct', actual, now,
        {corrected_by = a.corrected_by, corrected_at_ms = istr(now),
         correction_reason = a.correction_reason})
return {'ok', state, policy, rec.reserved_micros}
