-- delete_budget: remove one budget's definition and its set of end users, refused while open
-- reservations hold money in it (or in one of its users) unless forced, which charges them as
-- unknown first.
--
-- KEYS[1] meta hash   KEYS[2] definition hash 'sc:{TAG}:def:<budget_id>'
-- KEYS[3] open-lease zset   KEYS[4] the budget's users set 'sc:{TAG}:u:<budget_id>'
-- ARGV: budget_id, force ('0'|'1'), [now_ms]
-- Returns {'ok', charged_count, charged_micros, users_deleted} or {'in_use', open_count,
-- held_micros} or {'not_found'}.
-- Why: a budget deleted under an open hold would leave money held in a budget nobody can see.
-- Forced, each such reservation is charged as expiry charges a lease nobody settled (outcome
-- 'unknown', its whole hold committed: unknown means held, never dropped), whatever its policy,
-- and a late settle still corrects it. One script, so no reserve slips in between the check and
-- the delete. The counters stay, the budget's and each end user's alike: re-creating the budget
-- refills neither it nor a user's total, and a late settle of a reservation made before the
-- delete corrects the counter it was charged in. The users set goes (a budget put again under
-- the same id counts its users afresh against its users_max), and the budget's rate log and
-- concurrency count; a user's rate log expires a minute after its last call, and no user has a
-- concurrency count once no reservation is open. Every open lease of the tag is read, on an
-- operator's call only. Safe to run twice: the second finds no definition.
local budget_id, force = ARGV[1], ARGV[2]
if force ~= '0' and force ~= '1' then fail('BADARG', 'force') end
if redis.call('EXISTS', KEYS[2]) == 0 then
  return {'not_found'}
end
local prefix = prefix_of(KEYS[1])
-- A user's budget id is '<budget_id>/user:<user>'; no budget of an operator's has a 'user' scope.
local user_prefix = budget_id .. '/user:'
local holding, held = {}, 0
for _, rid in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  local key = prefix .. RECORD_KEY .. rid
  local rec = load_record(key)
  if rec and rec.state == 'open' then
    for _, leg in ipairs(parse_legs(rec.legs)) do
      if not leg.run and (leg.budget_id == budget_id
          or string.sub(leg.budget_id, 1, #user_prefix) == user_prefix) then
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
local users = redis.call('ZCARD', KEYS[4])
redis.call('DEL', KEYS[2], prefix .. RATE_KEY .. budget_id, prefix .. CONCURRENCY_KEY .. budget_id,
           prefix .. PENDING_USERS_KEY .. budget_id)
redis.call('UNLINK', KEYS[4])  -- freed off the server's main thread: it may hold users_max ids
return {'ok', #holding, istr(held), users}
