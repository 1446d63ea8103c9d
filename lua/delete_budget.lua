-- delete_budget: remove one budget's definition, refused while open reservations hold money in it
-- unless forced, which charges them as unknown first.
--
-- KEYS[1] meta hash   KEYS[2] definition hash 'sc:{TAG}:def:<budget_id>'
-- KEYS[3] open-lease zset
-- ARGV: budget_id, force ('0'|'1'), [now_ms]
-- Returns {'ok', charged_count, charged_micros} or {'in_use', open_count, held_micros} or
-- {'not_found'}.
-- Why: a budget deleted under an open hold would leave money held in a budget nobody can see.
-- Forced, each such reservation is charged as expiry charges a lease nobody settled (outcome
-- 'unknown', its whole hold committed: unknown means held, never dropped), whatever its policy,
-- and a late settle still corrects it. One script, so no reserve slips in between the check and
-- the delete. Its counters stay: re-creating the budget cannot refill it. Every open lease of the
-- tag is read, a bounded set (leases expire), on an operator's call only. Safe to run twice: the
-- second finds no definition.
local budget_id, force = ARGV[1], ARGV[2]
if force ~= '0' and force ~= '1' then fail('BADARG', 'force') end
if redis.call('EXISTS', KEYS[2]) == 0 then
  return {'not_found'}
end
local prefix = prefix_of(KEYS[1])
local holding, held = {}, 0
for _, rid in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  local key = prefix .. RECORD_KEY .. rid
  local rec = load_record(key)
  if rec and rec.state == 'open' then
    for _, leg in ipairs(parse_legs(rec.legs)) do
      if leg.budget_id == budget_id and not leg.run then
        holding[#holding + 1] = {key = key, rec = rec}
        held = held + tonumber(rec.reserved_micros)
        break
      end
    end
  end
end
if #holding > 0 and force == '0' then
  return {'in_use', #holding, istr(held)}
end
local now = ledger_now(ARGV[3])
for _, h in ipairs(holding) do
  h.rec.expire_policy = 'charge'
  resolve(prefix, h.key, KEYS[3], h.rec, 'expire', 0, now)
end
redis.call('DEL', KEYS[2])
return {'ok', #holding, istr(held)}
