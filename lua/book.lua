-- book: write spend an instance admitted while the ledger was unreachable (its outage journal).
--
-- KEYS[1] meta hash   KEYS[2] reservation
-- ARGV: wire.py BOOK_ARGS: ledger_id, admitted_at_ms, reserved_micros, actual_micros,
--   budget_ids, run, zones (of the admission's time), owner, record_tail, user, model (as
--   reserve's: its per_model legs are booked too, whatever its models.allow says now), [now_ms]
-- Returns {'ok', replayed 0|1} or {'ledger_reset'} / {'timezone', budget_id, timezone} /
-- {'clock', admitted_at_ms} / {'no_budget'}.
-- Why: nothing admitted during an outage may be lost. The spend is booked in the periods of the
-- moment it was admitted (the instance's clock: the ledger's was unreachable), unconditionally,
-- since the money is already spent; nothing was held for it, so all of it counts as overshoot
-- (the lifecycle's 'book' row). Booking the same journal entry twice (a retried flush) books it
-- once: its record is kept for the idempotency window. What it charged counts in its bill's day
-- (record_tail's bill, lib: count_day), as a settle's does.
local a = book_args(ARGV)
a.reading = true
local at_ms = int(a.admitted_at_ms, 'admitted_at_ms')
local held = int(a.reserved_micros, 'reserved_micros')
local actual = int(a.actual_micros, 'actual_micros')
-- A run's counter is stamped with the ledger's time, not the admission's: the run was active
-- until the booking at least as far as this ledger knows.
local now = ledger_now(a.now_ms)

local prefix = prefix_of(KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {'ok', 1}
end
local legs, status = resolve_legs(prefix, a, at_ms)
local fingerprint, price_version, model, bill =
  string.match(a.record_tail, '^([^\t]*)\t([^\t]*)\t([^\t]*)\t?([^\t]*)$')
if status then
  return status
end
if bill ~= '' and not UPSTREAMS[bill] then
  fail('BADARG', 'record_tail')
end
if #legs == 0 then
  return {'no_budget'}
end
-- A call admitted during an outage is booked whatever its limits say now; its end user is
-- counted in each budget that counts it already or has room for one more (for good if the call
-- cost anything: lib user_leg_moved), and the legs of a budget that has none are left out (the
-- call is booked in that budget alone).
if legs.users then
  local kept = {limits = legs.limits}
  local refused = {}
  for _, u in ipairs(legs.users) do
    if users_refusal({u}) then
      refused[u.budget_id .. '/user:' .. u.user] = true
    end
  end
  for _, leg in ipairs(legs) do
    if not refused[leg.budget_id] then kept[#kept + 1] = leg end
  end
  legs = kept
end
local state, outcome, _, committed, overshoot, released, _, late =
  book_effects('absent', 'charge', held, actual)
local seen
for _, leg in ipairs(legs) do
  local ck = counter_key(prefix, leg)
  if leg.run and run_stale(ck, now) then
    redis.call('DEL', ck)
  end
  local was_committed, was_reserved = counters(ck)
  hincr(ck, 'committed', committed)
  if committed ~= 0 and not leg.run and not leg.user and not leg.model then
    -- alerts: spend booked after an outage crosses thresholds like any other
    committed_moved(prefix, leg.budget_id, leg.window_key, leg.ceiling_micros,
                    tonumber(was_committed) + committed, istr(committed), now, seen, at_ms,
                    leg.velocity)
    seen = leg.budget_id
  end
  hincr(ck, 'overshoot', overshoot)
  if leg.user then
    user_leg_moved(prefix, leg.budget_id, ck, committed > 0)
  end
  if leg.run then
    touch_run(prefix, ck, now)
  elseif was_committed == '0' and was_reserved == '0' and leg.window_key ~= 'total' then
    keep_window(prefix, ck, leg.resets_at_ms)
  end
end
count_day(prefix, bill, istr(at_ms), committed)  -- the bill's day, as a settle counts it
keep(KEYS[2], {state = state, reserved_micros = istr(held), expire_policy = 'charge',
               retention_ms = istr(IDEMPOTENCY_WINDOW_MS), owner = a.owner,
               expires_at_ms = istr(at_ms), created_ms = istr(at_ms),
               actual_micros = istr(actual),
               released_micros = istr(released), overshoot_micros = istr(overshoot),
               late = late and '1' or '0', outcome = outcome, resolved_ms = istr(now),
               fingerprint = fingerprint, price_version = price_version, model = model,
               bill = bill},
     IDEMPOTENCY_WINDOW_MS)
return {'ok', 0}
