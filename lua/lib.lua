-- What the ledger scripts share. A script is built from the statements of the generated prelude
-- (core/stores/wire.py: the readers and writers of the arguments, records and definitions by
-- their Python names, the limits of core/limits.py, the key parts of core/stores/keys.py, and
-- the lifecycle's table compiled as `effects` and `committed_of`) and of this file that it uses
-- (core/stores/scripts.py), then its own file.
--
-- Conventions every script follows:
--   * Names are Python's: a field, an argument and a table key carry the name the Python gives
--     the same thing, and no position is read outside the generated readers and writers.
--   * The server runs every statement of a script on every call, and Lua's string handling is
--     the dearest thing a script does: each top-level statement here is one 'local' (with its
--     comment right above it), so a script carries only what it runs; values stay the strings
--     they arrived as unless the script computes with them.
--   * Money is integer micro-dollars. Lua numbers are doubles, exact below 2**53, so every
--     integer argument is checked against INT_MAX before use.
--   * Numbers are written back with istr() (string.format '%d'), never tostring(): Lua 5.1's
--     tostring keeps 14 significant digits and prints 1.7000000000001e+15.
--   * All argument checks run before the first write: a Lua error does not roll back writes
--     that came before it.
--   * KEYS[1] is the tag's meta hash 'sc:{TAG}:meta'. Every other key a script touches is built
--     from the same 'sc:{TAG}:' prefix, so all of them hash to one slot and the scripts run
--     unchanged on Redis Cluster.
--   * Time is the ledger's: Redis TIME, unless the store passes now_ms (tests that inject a
--     clock; production sends none).

local function fail(code, detail)
  error({err = code .. ' ' .. detail})
end

local function int(s, name)
  if not s or #s == 0 or #s > 16 or string.find(s, '%D') then
    fail('BADARG', name)
  end
  local n = tonumber(s)
  if n > INT_MAX then
    fail('BADARG', name)
  end
  return n
end

local function istr(n)
  return string.format('%d', n)
end

-- An amount of a step as text: the text at hand where it is the held or the actual amount
-- (string.format is the dearest thing a step does with a number).
local function text_of(n, held, held_text, actual, actual_text)
  if n == 0 then
    return '0'
  elseif n == held then
    return held_text
  elseif n == -held then
    return '-' .. held_text
  elseif n == actual then
    return actual_text
  end
  return istr(n)
end

local function ledger_now(arg)
  if arg then
    return int(arg, 'now_ms')
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function prefix_of(meta_key)
  return string.sub(meta_key, 1, #meta_key - #META_KEY)
end

local function id_of(prefix, record_key)
  return string.sub(record_key, #prefix + #RECORD_KEY + 1)
end

-- The ledger id is written into each tag's meta hash (and each budget's definition) when a
-- budget is put. A missing or different id means the data this instance enforced against is
-- gone (flushed, restarted without persistence, or replaced), and enforcing now would serve a
-- refilled budget.
local function ledger_matches(meta_key, ledger_id)
  return redis.call('HGET', meta_key, 'ledger') == ledger_id
end

-- What follows a budget's leg that a velocity alarm watched when it was held (parse_legs).
-- A leg is one (budget, period window) pair a reservation holds money in, stored on the
-- reservation as 'budget_id|window_key|ceiling_micros|resets_at_ms|outage_allowance_micros',
-- then '|run' for a run's leg, or '|' and the flags of a budget's leg, in this order: 'e' an end
-- user's budget (core/budgets.py BudgetId.user), whose spend raises no alerts; 'm' a budget's
-- calls of one model (BudgetId.model, its per_model limits), which raise none either; 'c' the
-- leg that holds one of its budget's concurrency slots (a budget's first leg, when it has
-- concurrent_max);
-- 'v' a velocity alarm watched it when it was held (a settle reads the tag's velocity alarms only
-- for a watched leg: an alarm watches the calls held while it is set). Ids never contain '|' or
-- ' ' (core/budgets.py enforces it). The numeric parts are kept as the strings they arrived as,
-- never re-formatted.
local FLAGS = {user = 'e', model = 'm', slot = 'c', velocity = 'v'}

-- The flags of a leg whose spend raises no alerts (an end user's, a model's): its budget's does.
local QUIET_FLAGS = '[em]'

-- A leg in a reservation's legs, for string.gmatch: its budget id, window key, ceiling and
-- flags ('' for none, 'run' for a run's).
local LEG_PATTERN = '([^ |]+)|([^ |]+)|([^ |]+)|[^ |]*|[^ |]*|?(%a*)'

-- Whether a leg's flags carry the velocity flag: the last flag when it is there.
local function watched(flags)
  return string.sub(flags, -1) == FLAGS.velocity
end

local function flags_of(leg)
  if leg.run then
    return '|run'
  end
  if not (leg.user or leg.model or leg.slot or leg.velocity) then
    return ''
  end
  local f = (leg.user and FLAGS.user or '') .. (leg.model and FLAGS.model or '') ..
            (leg.slot and FLAGS.slot or '') .. (leg.velocity and FLAGS.velocity or '')
  return f ~= '' and '|' .. f or ''
end

local function parse_legs(s)
  local legs = {}
  for raw in string.gmatch(s, '[^ ]+') do
    local budget_id, window_key, ceiling, resets_at, allowance, mark =
      string.match(raw, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|?(%a*)$')
    local run = mark == 'run'
    legs[#legs + 1] = {budget_id = budget_id, window_key = window_key, ceiling_micros = ceiling,
                       resets_at_ms = resets_at, outage_allowance_micros = allowance, run = run,
                       user = not run and string.find(mark, FLAGS.user, 1, true) ~= nil,
                       model = not run and string.find(mark, FLAGS.model, 1, true) ~= nil,
                       slot = not run and string.find(mark, FLAGS.slot, 1, true) ~= nil,
                       velocity = not run and string.find(mark, FLAGS.velocity, 1, true) ~= nil}
  end
  return legs
end

local function encode_legs(legs)
  local out
  for _, leg in ipairs(legs) do
    local part = leg.budget_id .. '|' .. leg.window_key .. '|' .. leg.ceiling_micros .. '|' ..
                 leg.resets_at_ms .. '|' .. leg.outage_allowance_micros .. flags_of(leg)
    out = out and out .. ' ' .. part or part
  end
  return out or ''
end

-- A budget's concurrency slots are its open reservations' ids, scored by their lease ends (a
-- sorted set: Redis drops it when its last member goes). A reservation leaving the open state
-- gives back the slot of each budget it held one in (flag 'c'): removing an id twice removes it
-- once. A slot whose lease ended counts no more (rate_refusal trims it), so one that no step gave
-- back frees itself.
local function free_slot(prefix, budget_id, rid)
  redis.call('ZREM', prefix .. CONCURRENCY_KEY .. budget_id, rid)
end

local function free_slots(prefix, legs, rid)
  for budget_id, _, _, flags in string.gmatch(legs, LEG_PATTERN) do
    if flags ~= 'run' and string.find(flags, FLAGS.slot, 1, true) then
      free_slot(prefix, budget_id, rid)
    end
  end
end

-- One leg's status as every script answers it: core/ledger.py LegStatus' fields in order, '|'
-- between them (wire.py leg reads it), the counters as the strings Redis keeps them.
local function leg_status(leg, committed, reserved, overshoot)
  return leg.budget_id .. '|' .. leg.window_key .. '|' .. leg.ceiling_micros .. '|' ..
         committed .. '|' .. reserved .. '|' .. overshoot .. '|' .. leg.resets_at_ms .. '|' ..
         leg.outage_allowance_micros
end

local function counter_key(prefix, leg)
  return prefix .. COUNTER_KEY .. leg.budget_id .. '|' .. leg.window_key
end

-- A leg's counters, as the strings Redis keeps them.
local function counters(key)
  local v = redis.call('HMGET', key, 'committed', 'reserved', 'overshoot')
  return v[1] or '0', v[2] or '0', v[3] or '0'
end

-- What an API key made in the current quota windows: the day window's index and its counts
-- (core/limits.py STATE_QUOTA_WINDOW_MS), and the count of records it made in the current
-- records window (RECORDS_QUOTA_WINDOW_MS, minutes: what a key keeps of those is its rate times
-- how long they are kept), from the key's quota hash ('sc:{TAG}:q:<owner>'); a count of an
-- earlier window counts nothing. What it bounds is counted by the script that makes it, so no
-- number of concurrent calls can pass a bound.
local QUOTA_FIELDS = {'records', 'runs', 'replies', 'reply_bytes'}

local function quota_read(qkey, now)
  local window = math.floor(now / STATE_QUOTA_WINDOW_MS)
  local recent_window = math.floor(now / RECORDS_QUOTA_WINDOW_MS)
  local v = redis.call('HMGET', qkey, 'window', 'records', 'runs', 'replies', 'reply_bytes',
                       'recent_window', 'recent')
  local current = v[1] == istr(window)
  local used = {window = window, recent_window = recent_window,
                recent = v[6] == istr(recent_window) and tonumber(v[7] or '0') or 0}
  for i, name in ipairs(QUOTA_FIELDS) do
    used[name] = current and tonumber(v[i + 1] or '0') or 0
  end
  return used
end

-- Write back the counts of `used` (quota_read's, added to), kept two day windows after its own.
local function quota_write(qkey, used)
  local args = {'window', istr(used.window), 'recent_window', istr(used.recent_window),
                'recent', istr(used.recent)}
  for _, name in ipairs(QUOTA_FIELDS) do
    args[#args + 1] = name
    args[#args + 1] = istr(used[name])
  end
  redis.call('HSET', qkey, unpack(args))
  redis.call('PEXPIREAT', qkey, istr((used.window + 2) * STATE_QUOTA_WINDOW_MS))
end

-- A refusal for a quota: which one, and the seconds until its window ends (the records window
-- for 'recent', the day window for the others).
local function quota_refusal(kind, used, now)
  local ends_at = kind == 'recent' and (used.recent_window + 1) * RECORDS_QUOTA_WINDOW_MS
    or (used.window + 1) * STATE_QUOTA_WINDOW_MS
  return {'state_quota', kind == 'recent' and 'records' or kind,
          istr(math.ceil((ends_at - now) / 1000))}
end

-- A counter that holds spend carries no expiry: a Redis that evicts keys with one (the
-- volatile-* policies) must never find a counter to drop, which would refill its budget. Such
-- counters go by a sweep instead: each windowed counter (day, week, month; a budget's or a
-- user's) is listed in its tag's windows index by when it may go (COUNTER_RETENTION_MS after its
-- window ends), each run's counter in the tag's runs index by its last write (it goes
-- RUN_COUNTER_IDLE_MS after). sweep_counters deletes a bounded batch of each whose time has
-- come; a hold runs it when it opens a window's counter or a run's, so a tag sweeps as often as
-- it makes counters, and expire.lua (the sweeper's) runs it for tags that see no calls. The
-- indexes carry no expiry either and hold one member per counter.
local function keep_window(prefix, ck, resets_at_ms)
  redis.call('ZADD', prefix .. WINDOWS_KEY, istr(tonumber(resets_at_ms) + COUNTER_RETENTION_MS),
             string.sub(ck, #prefix + 1))
end

local function sweep_index(prefix, index, before_ms)
  local gone = redis.call('ZRANGEBYSCORE', index, '-inf', istr(before_ms), 'LIMIT', '0',
                          istr(COUNTER_SWEEP_BATCH_MAX))
  for _, suffix in ipairs(gone) do
    redis.call('DEL', prefix .. suffix)
  end
  if #gone > 0 then
    redis.call('ZREM', index, unpack(gone))
  end
  return #gone
end

local function sweep_counters(prefix, now)
  return sweep_index(prefix, prefix .. WINDOWS_KEY, now)
    + sweep_index(prefix, prefix .. RUNS_KEY, now - RUN_COUNTER_IDLE_MS)
end

-- A run's counter lives while its run is active. Every write to it stamps the ledger's time in
-- its 'seen' field and in the runs index, so the sweep drops it RUN_COUNTER_IDLE_MS without a
-- call, and a counter 'seen' that long ago counts as gone even before the sweep comes. One with
-- no 'seen' (restored from an export that kept none) lives until its next write stamps it.
local function run_stale(ck, now)
  local seen = redis.call('HGET', ck, 'seen')
  return seen and tonumber(seen) + RUN_COUNTER_IDLE_MS <= now
end

local function touch_run(prefix, ck, now)
  local now_text = istr(now)
  redis.call('HSET', ck, 'seen', now_text)
  redis.call('ZADD', prefix .. RUNS_KEY, now_text, string.sub(ck, #prefix + 1))
end

-- Whether a settle, release or expiry may write to a leg's counter: a budget's always; a run's
-- only while it lives. A run that went idle is over, and writing to its gone counter would
-- recreate it holding only this call's delta (a negative balance for a refund).
local function writable(ck, leg, now)
  if not leg.run then
    return true
  end
  if run_stale(ck, now) then
    redis.call('DEL', ck)
    return false
  end
  return redis.call('EXISTS', ck) == 1
end

local function hincr(key, field, delta)
  if delta ~= 0 then
    redis.call('HINCRBY', key, field, istr(delta))
  end
end

-- ==== Alerts ====================================================================================
-- Threshold crossings, the first refusal of a period and velocity alarms are decided inside the
-- script that moves the money: a marker written with the decision (HSETNX in the counter for a
-- threshold or a refusal, SET NX for a velocity window) makes one event per (budget, period
-- window, threshold) however many instances settle at once, and goes when its counter goes. A
-- step reads nothing more unless its spend moved a whole percent of a ceiling or its tag has a
-- velocity alarm; an event is written only on a crossing.

-- One event into the tag's outbox: a hash under its id, which delivery reads; the id in the
-- outbox (by when to try it next) and in the alert log (by when it happened). `fields`: what the
-- event is about, name and value in turn (core/alerts.py EVENT_FIELDS).
local function alert_put(prefix, id, now, fields)
  local key = prefix .. ALERT_KEY .. id
  local now_text = istr(now)
  redis.call('HSET', key, 'event_id', id, 'at_ms', now_text, 'attempts', '0', 'state', 'pending',
             unpack(fields))
  redis.call('PEXPIRE', key, istr(ALERT_RETENTION_MS))
  local outbox, log = prefix .. OUTBOX_KEY, prefix .. ALERT_LOG_KEY
  redis.call('ZADD', outbox, now_text, id)
  redis.call('PEXPIRE', outbox, istr(ALERT_RETENTION_MS))
  redis.call('ZADD', log, now_text, id)
  redis.call('PEXPIRE', log, istr(ALERT_RETENTION_MS))
end

-- An event's id: a digest of what it is about, so a receiver deduplicates on it and a repeat
-- writes the same one (core/alerts.py event_id_of).
local function alert_id(about)
  return 'evt_' .. string.sub(redis.sha1hex(about), 1, 32)
end

-- A budget's event: a threshold crossed, a refusal, a velocity alarm.
local function alert_emit(prefix, kind, budget_id, period_key, threshold, committed, ceiling, now)
  alert_put(prefix, alert_id(kind .. '|' .. budget_id .. '|' .. period_key .. '|' .. threshold),
            now, {'type', kind, 'budget_id', budget_id, 'period_key', period_key,
                  'threshold_pct', threshold, 'committed_micros', committed,
                  'ceiling_micros', ceiling})
end

-- A refusal the ledger decided, counted by its error code for the whole ledger's metrics
-- (core/ledger.py Reconciliation.refusal_counts).
local function count_refusal(prefix, code)
  redis.call('HINCRBY', prefix .. REFUSED_KEY, code, '1')
end

-- The spend at which `pct` percent of `ceiling` is reached, rounded up, exactly: ceiling * pct
-- can pass 2**53, the parts below cannot.
local function threshold_micros(ceiling, pct)
  local hundreds = math.floor(ceiling / 100)
  return hundreds * pct + math.ceil((ceiling - hundreds * 100) * pct / 100)
end

-- A budget's committed spend in one window went from after - delta to `after` (delta > 0):
-- an event for each of its thresholds that this crossed first. The whole percentage, in doubles,
-- is within far less than the slack of the exact one, so a step that moves it by no whole
-- percent crosses nothing and reads nothing. Below 1% of the ceiling it crosses nothing either
-- (thresholds are 1 to 100; after * 100 is exact while it is below the ceiling, under 2**53):
-- the slack (a millionth of a percent) alone would send every step of a window's first
-- hundred-millionth of its ceiling to read the thresholds.
-- Returns the ledger's now if it read it.
local function alert_thresholds(prefix, budget_id, window_key, ceiling_text, after, delta, now)
  local ceiling = tonumber(ceiling_text)
  local before = after - delta
  if ceiling <= 0 or after * 100 < ceiling or math.floor(after * 100 / ceiling + 1e-6)
      == math.floor(before * 100 / ceiling - 1e-6) then
    return now
  end
  local stored = redis.call('HGET', prefix .. DEFINITION_KEY .. budget_id, 'alert_thresholds_pct')
  local ck = prefix .. COUNTER_KEY .. budget_id .. '|' .. window_key
  -- Every definition holds its thresholds ('' for none); one deleted since it was read holds none.
  for pct in string.gmatch(stored or '', '%d+') do
    local at = threshold_micros(ceiling, tonumber(pct))
    if before < at and after >= at and redis.call('HSETNX', ck, 'alerted:' .. pct, '1') == 1 then
      now = now or ledger_now(nil)
      alert_emit(prefix, 'budget.threshold_crossed', budget_id, window_key, pct, istr(after),
                 ceiling_text, now)
    end
  end
  return now
end

-- A budget's velocity alarm, if its tag's meta hash lists one for it (' budget_id,window_s,
-- max_micros,max_rate_multiple_milli,pause' per budget; 0 for a rule not set): spend in the
-- window's slots above max_micros, or above the multiple of the trailing hourly rate, emits
-- budget.velocity once per window, and pauses the budget if asked to.
local function alert_velocity(prefix, alarms, budget_id, delta_text, now)
  local at = string.find(alarms, ' ' .. budget_id .. ',', 1, true)
  if not at then
    return
  end
  local window_s, max_micros, multiple_milli, pause = string.match(
    alarms, '^ [^,]+,(%d+),(%d+),(%d+),(%d)', at)
  local window_ms = tonumber(window_s) * 1000
  local slot_ms = window_ms / VELOCITY_SLOTS
  local slot = math.floor(now / slot_ms)
  local base = prefix .. VELOCITY_KEY .. budget_id .. '|'
  if redis.call('INCRBY', base .. istr(slot), delta_text) == tonumber(delta_text) then
    redis.call('PEXPIRE', base .. istr(slot), istr(2 * window_ms))
  end
  local slots = {}
  for i = 0, VELOCITY_SLOTS - 1 do
    slots[#slots + 1] = base .. istr(slot - i)
  end
  local spent = 0
  for _, v in ipairs(redis.call('MGET', unpack(slots))) do
    spent = spent + (tonumber(v) or 0)
  end
  local over = tonumber(max_micros) > 0 and spent > tonumber(max_micros)
  if not over and tonumber(multiple_milli) > 0 then
    -- The trailing hourly rate: the spend of the whole hours before this one, up to
    -- VELOCITY_TRAILING_HOURS of them, over the hours since the oldest with spend (a budget a
    -- few hours old is measured against its own few hours). With no history there is no rate
    -- to multiply, and only max_micros can fire. An alarm's comparison, not money: doubles.
    local hour = math.floor(now / SPEND_BUCKET_MS)
    local hours = {}
    for i = 1, VELOCITY_TRAILING_HOURS do
      hours[#hours + 1] = prefix .. SPEND_KEY .. budget_id .. '|' .. istr(hour - i)
    end
    local trailing, span = 0, 0
    for i, v in ipairs(redis.call('MGET', unpack(hours))) do
      local micros = tonumber(v) or 0
      trailing = trailing + micros
      if micros ~= 0 then
        span = i
      end
    end
    over = trailing > 0 and spent * span * 3600000 * 1000
      > tonumber(multiple_milli) * trailing * window_ms
  end
  if not over then
    return
  end
  local window = math.floor(now / window_ms)
  if redis.call('SET', prefix .. VELOCITY_MARK_KEY .. budget_id .. '|' .. istr(window), '1',
                'NX', 'PX', istr(2 * window_ms)) then
    alert_emit(prefix, 'budget.velocity', budget_id, 'velocity:' .. istr(window * window_ms),
               '', istr(spent), max_micros, now)
    if pause == '1' then
      redis.call('HSET', prefix .. DEFINITION_KEY .. budget_id, 'paused', '1',
                 'paused_at_ms', istr(now))
    end
  end
end

-- What one step's booking in a budget's committed spend sets off: `delta_text` (not '0') was
-- added in the window `window_key` of the leg 'budget_id|window_key|ceiling...', whose counter
-- now holds `after`. Thresholds per window; the hourly spend bucket and the velocity alarm once
-- per budget of the step (`seen`: the budget of the leg before, whose legs come together).
-- The bucket is the hour of `spent_at_ms`, the call's own time (when it was reserved, or
-- admitted for a journal's entry), as its periods are the ones its reservation held: a call is
-- counted in one hour whenever it settles, and a settle needs no clock for it. A velocity alarm
-- measures spend as it lands, in the ledger's now, for a leg it `watched` (parse_legs).
-- Returns the ledger's now if it was read.
local function committed_moved(prefix, budget_id, window_key, ceiling_text, after, delta_text,
                               now, seen, spent_at_ms, watched)
  local delta = tonumber(delta_text)
  if delta > 0 then
    now = alert_thresholds(prefix, budget_id, window_key, ceiling_text, after, delta, now)
  end
  if seen ~= budget_id then
    if not spent_at_ms then
      now = now or ledger_now(nil)
      spent_at_ms = now
    end
    local bucket = prefix .. SPEND_KEY .. budget_id .. '|' ..
                   istr(math.floor(spent_at_ms / SPEND_BUCKET_MS))
    if redis.call('INCRBY', bucket, delta_text) == delta then
      redis.call('PEXPIRE', bucket, istr(SPEND_BUCKET_RETENTION_MS))
    end
    if delta > 0 and watched then
      local alarms = redis.call('HGET', prefix .. META_KEY, VELOCITY_FIELD)
      if alarms then
        now = now or ledger_now(nil)
        alert_velocity(prefix, alarms, budget_id, delta_text, now)
      end
    end
  end
  return now
end

-- The first refusal (budget_exceeded) of a budget in a window: budget.exceeded, once. A run's
-- leg has no budget to alert on; an end user's or a model's raises none (its budget's spend
-- does). A counter this makes exist goes when a held one would (keep_window).
local function alert_refused(prefix, leg, now)
  if leg.run or leg.user or leg.model
      or redis.call('HSETNX', leg.key, 'alerted:exceeded', '1') == 0 then
    return
  end
  if leg.committed == '0' and leg.reserved == '0' and leg.window_key ~= 'total' then
    keep_window(prefix, leg.key, leg.resets_at_ms)
  end
  alert_emit(prefix, 'budget.exceeded', leg.budget_id, leg.window_key, '', leg.committed,
             leg.ceiling_micros, now)
end
-- ==== end of alerts ==============================================================================

-- What a step does for an end user's leg (flag 'e', budget id '<budget>/user:<user>') beyond its
-- counters: a charge (`charged`: committed spend above zero booked in it) gives the user its
-- place among the budget's users for good, out of the pending ones (users_refusal); a step that
-- leaves the user nothing spent and nothing open drops the counter, which holds nothing, and
-- gives the pending place back (a user whose calls were all released leaves nothing behind).
local function user_leg_moved(prefix, budget_id, ck, charged)
  local parent, user = string.match(budget_id, '^(.*)/user:([^/]*)$')
  if charged then
    redis.call('ZADD', prefix .. USERS_KEY .. parent, '0', user)
    redis.call('ZREM', prefix .. PENDING_USERS_KEY .. parent, user)
    return
  end
  local left = redis.call('HMGET', ck, 'committed', 'reserved')
  if (left[1] or '0') == '0' and (left[2] or '0') == '0' then
    redis.call('DEL', ck)
    redis.call('ZREM', prefix .. WINDOWS_KEY, string.sub(ck, #prefix + 1))
    redis.call('ZREM', prefix .. PENDING_USERS_KEY .. parent, user)
  end
end

-- core/lifecycle.py is the one statement of what each step of a reservation books: HOLDINGS
-- (what a reservation holds in its legs' counters, by state and policy) and TRANSITIONS (which
-- event moves it from which state to which). The prelude compiles them into `effects` and
-- `committed_of` (the only place the scripts get a delta from), and the conformance suite runs
-- every row of the table against every store.
-- Book one step in every leg of `legs` (a record's) that it may write to: the deltas of its
-- counters' reserved, committed and overshoot. `now` is read only for a run's leg. The legs are
-- read in place (a step needs only each one's counter) and the deltas formatted once for all.
-- `spent_at_ms`: the reservation's own time, for alerts' hourly bucket (nil: the ledger's now).
local function apply(prefix, legs, reserved, committed, overshoot, now, spent_at_ms)
  reserved = reserved ~= 0 and istr(reserved)
  committed = committed ~= 0 and istr(committed)
  overshoot = overshoot ~= 0 and istr(overshoot)
  local seen
  for budget_id, window_key, ceiling, flags in string.gmatch(legs, LEG_PATTERN) do
    local ck = prefix .. COUNTER_KEY .. budget_id .. '|' .. window_key
    local run = flags == 'run'
    if not run or writable(ck, {run = true}, now) then
      if reserved then redis.call('HINCRBY', ck, 'reserved', reserved) end
      if committed then
        local after = redis.call('HINCRBY', ck, 'committed', committed)
        if not run and not string.find(flags, QUIET_FLAGS) then
          now = committed_moved(prefix, budget_id, window_key, ceiling, after, committed, now,
                                seen, spent_at_ms, watched(flags))
          seen = budget_id
        end
      end
      if overshoot then redis.call('HINCRBY', ck, 'overshoot', overshoot) end
      if not run and string.find(flags, FLAGS.user, 1, true) then
        user_leg_moved(prefix, budget_id, ck, committed and tonumber(committed) > 0)
      end
      if run then
        local left = redis.call('HMGET', ck, 'committed', 'reserved')
        if (left[1] or '0') == '0' and (left[2] or '0') == '0' then
          -- A run with nothing spent and nothing open is not kept: nothing of it can be lost,
          -- and a key minting run ids for calls that spend nothing leaves nothing behind.
          redis.call('DEL', ck)
          redis.call('ZREM', prefix .. RUNS_KEY, string.sub(ck, #prefix + 1))
        else
          touch_run(prefix, ck, now)
        end
      end
    end
  end
  return now
end

-- The common case of settle and release, written out once: an open reservation of a gateway
-- call, resolved by its owner, in budgets' legs (no run's), kept only for resends once resolved,
-- so its head is all this reads of it. `resolve` does the same for every case; this is what it
-- does for this one, without what the others need, since every gateway call takes it.
-- `step` is the lifecycle's settle_effects or release_effects; `actual` 0 for a release.
-- Returns the script's answer, `now` and when the call began (created_ms), or nil when the
-- record is not this case.
local function resolve_gateway_call(prefix, keys, owner, step, actual, actual_text, now)
  local stored = redis.call('GET', keys[2])
  if not stored then
    return nil, now
  end
  local state, reserved_micros, expire_policy, retention_ms, rec_owner, legs, _, created_ms =
    record_head(stored)
  if state ~= 'open' or rec_owner ~= owner or retention_ms ~= RESEND_WINDOW_MS_TEXT
      or string.find(legs, '|run', 1, true) then
    return nil, now
  end
  local held = tonumber(reserved_micros)
  local to, outcome, reserved, committed, overshoot, released, _, late =
    step(state, expire_policy, held, actual)
  reserved = text_of(reserved, held, reserved_micros, actual, actual_text)
  committed = text_of(committed, held, reserved_micros, actual, actual_text)
  overshoot = text_of(overshoot, held, reserved_micros, actual, actual_text)
  local seen
  for budget_id, window_key, ceiling, flags in string.gmatch(legs, LEG_PATTERN) do
    local ck = prefix .. COUNTER_KEY .. budget_id .. '|' .. window_key
    if reserved ~= '0' then redis.call('HINCRBY', ck, 'reserved', reserved) end
    if committed ~= '0' then
      local after = redis.call('HINCRBY', ck, 'committed', committed)
      if flags == '' or not string.find(flags, QUIET_FLAGS) then  -- alerts
        now = committed_moved(prefix, budget_id, window_key, ceiling, after, committed, now,
                              seen, tonumber(created_ms), watched(flags))
        seen = budget_id
      end
    end
    if overshoot ~= '0' then redis.call('HINCRBY', ck, 'overshoot', overshoot) end
    if flags ~= '' then
      if string.find(flags, FLAGS.slot, 1, true) then
        free_slot(prefix, budget_id, id_of(prefix, keys[2]))
      end
      if string.find(flags, FLAGS.user, 1, true) then
        user_leg_moved(prefix, budget_id, ck, tonumber(committed) > 0)
      end
    end
  end
  -- A gateway call's answer to a resend, its fingerprint '' (core/service.py): in the order
  -- of pack_resolved's parameters (wire.py RESOLVED_FIELDS).
  redis.call('SET', keys[2], pack_resolved(
    to, reserved_micros, expire_policy, retention_ms, owner,
    to == 'settled' and actual_text or '',
    text_of(released, held, reserved_micros, actual, actual_text), overshoot,
    late and '1' or '0', outcome, ''), 'PX', retention_ms)
  redis.call('ZREM', keys[3], id_of(prefix, keys[2]))
  return {'ok', state, expire_policy, reserved_micros}, now, created_ms
end

-- The reservation under `key` by RECORD_FIELDS' names; nil if there is none.
local function load_record(key)
  local v = redis.call('GET', key)
  return v and (unpack_record(v) or fail('BADARG', 'record'))
end

-- How settle and release begin: the common case (resolve_gateway_call) answered at once; else
-- the record of the general case, or 'not_found' for none this owner may see. Returns the
-- answer or nil, the record or nil, `now`, and with an answer of the common case when the call
-- began (created_ms).
local function resolve_or_load(prefix, keys, owner, step, actual, actual_text, now)
  local answer, created_ms
  answer, now, created_ms = resolve_gateway_call(prefix, keys, owner, step, actual, actual_text,
                                                 now)
  if answer then
    return answer, nil, now, created_ms
  end
  local rec = load_record(keys[2])
  if not rec or rec.owner ~= owner then
    return {'not_found'}, nil, now
  end
  return nil, rec, now
end

local function keep(key, rec, ttl_ms)
  redis.call('SET', key, pack_record(rec), 'PX', istr(ttl_ms))
end

-- Keep a reservation that a step resolved for as long as something can still need it
-- (core/limits.py says why each): an unknown outcome and an operator's correction for an
-- operator; a lease given back at expiry for a late settle, within its caller's retention and
-- at least one more lease; a settle or release for its caller's retention, without its legs,
-- which no step reads again; and a gateway call's (RESEND_WINDOW_MS) with only what a resend
-- reads.
local function keep_resolved(key, rec)
  local retention = tonumber(rec.retention_ms)
  if rec.outcome == 'unknown' or rec.outcome == 'corrected' then
    keep(key, rec, UNKNOWN_OUTCOME_RETENTION_MS)
    return
  end
  if retention > REPLAY_WINDOW_MS and committed_of(
      rec.state, rec.expire_policy, tonumber(rec.reserved_micros),
      tonumber(rec.actual_micros or '0')) == 0 then
    retention = REPLAY_WINDOW_MS  -- it moved no money: kept for replays only
  end
  if rec.state == 'expired' then
    local lease = (tonumber(rec.expires_at_ms) or 0) - (tonumber(rec.created_ms) or 0)
    keep(key, rec, math.max(retention, lease))
  elseif retention > RESEND_WINDOW_MS then
    rec.legs = ''
    keep(key, rec, retention)
  else
    redis.call('SET', key, pack_resolved(
      rec.state, rec.reserved_micros, rec.expire_policy, rec.retention_ms, rec.owner,
      rec.actual_micros or '', rec.released_micros, rec.overshoot_micros, rec.late,
      rec.outcome, rec.fingerprint or ''), 'PX', rec.retention_ms)
  end
end

-- What a call's charge moved, `delta` micros of committed spend (a settle's, an expiry's charge,
-- a late settle's or an operator's correction of it, up or down; an outage's booking), counted
-- in the day counter of its bill on the UTC day it began (created_ms): what core/reconcile.py
-- compares with that provider's cost report. A `bill` that names none ('': a record kept before
-- reservations named their bill, settled by no gateway) counts nothing. A day's count never goes below zero
-- (a correction of a charge counted before bills were recorded), and goes when it is zero.
local function count_day(prefix, bill, created_text, delta)
  if delta == 0 or not UPSTREAMS[bill] then
    return
  end
  local day = math.floor(int(created_text, 'created_ms') / DAY_MS)
  local key = prefix .. DAILY_SPEND_KEY .. bill .. '|' .. istr(day)
  local after = redis.call('INCRBY', key, istr(delta))
  if after <= 0 then
    redis.call('DEL', key)
  elseif after == delta then
    redis.call('PEXPIREAT', key, istr((day + 1) * DAY_MS + DAILY_SPEND_RETENTION_MS))
  end
end

-- One step that resolves a reservation (settle, release, expire, correct): booked in its legs
-- as the lifecycle says, recorded on it, and its lease taken off the open set. `rec` needs only
-- its head (wire.py RECORD_HEAD) for a record kept RESEND_WINDOW_MS, all of it otherwise.
-- `actual` is what a settle or correction charges; `now` (nil to read it only if needed) is the
-- ledger's time; `upstream` the bill a settle names, counted on for a record that names none.
-- `rec` is left as it was kept.
local function resolve(prefix, key, open_key, rec, event, actual, now, extra, upstream)
  local to, outcome, reserved, committed, overshoot, released, _, late =
    effects(event, rec.state, rec.expire_policy, tonumber(rec.reserved_micros), actual)
  if rec.created_ms and rec.created_ms ~= '' then
    -- A record without a bill (kept from before reservations recorded one) counts on the
    -- settle's upstream only while open: what resolves it later corrects a charge never counted.
    count_day(prefix, (rec.bill ~= '' and rec.bill) or (rec.state == 'open' and upstream) or '',
              rec.created_ms, committed)
  end
  if rec.state == 'open' then
    free_slots(prefix, rec.legs, id_of(prefix, key))
  end
  local long = to == 'expired' or extra or tonumber(rec.retention_ms) > RESEND_WINDOW_MS
  if not now and (long or string.find(rec.legs, '|run', 1, true)) then
    now = ledger_now(nil)
  end
  apply(prefix, rec.legs, reserved, committed, overshoot, now, tonumber(rec.created_ms or ''))
  rec.state, rec.outcome = to, outcome
  if now and long then
    rec.resolved_ms = istr(now)
  end
  if to == 'settled' then
    rec.actual_micros = istr(actual)
  end
  rec.released_micros, rec.overshoot_micros = istr(released), istr(overshoot)
  rec.late = late and '1' or '0'
  if extra then
    for name, value in pairs(extra) do
      rec[name] = value
    end
  end
  keep_resolved(key, rec)
  redis.call('ZREM', open_key, id_of(prefix, key))
end

-- A repeat of a reserve (or a correction) of a reservation that is no longer open: what became
-- of it, and what it charged (its committed share: lifecycle.charged_micros).
local function resolved_reply(rec)
  return {'resolved', rec.state, rec.outcome, rec.reserved_micros,
          committed_of(rec.state, rec.expire_policy, tonumber(rec.reserved_micros),
                       tonumber(rec.actual_micros))}
end

-- A repeat of a settle (or correction) already made, as it was answered.
local function settled_reply(rec)
  return {'replayed', rec.actual_micros, rec.released_micros, rec.overshoot_micros, rec.late}
end

-- Expiry of one lease, by the policy chosen when it was taken and stored on it: 'charge' books
-- the hold as spent with outcome 'unknown' (a worker that died may have been billed by the
-- provider); 'release' returns it to the budget.
local function expire_one(prefix, open_key, rid, now)
  local key = prefix .. RECORD_KEY .. rid
  local rec = load_record(key)
  if not rec or rec.state ~= 'open' then
    redis.call('ZREM', open_key, rid)
    return 0
  end
  resolve(prefix, key, open_key, rec, 'expire', 0, now)
  return 1
end

local function reclaim(prefix, open_key, now, batch_max)
  local ids = redis.call('ZRANGEBYSCORE', open_key, '-inf', istr(now), 'LIMIT', '0',
                        istr(batch_max))
  local n = 0
  for _, rid in ipairs(ids) do
    n = n + expire_one(prefix, open_key, rid, now)
  end
  return n
end

-- Period windows are computed by the caller (time zones need a tz database, Lua has none):
-- `zones` holds, per time zone, the day, week and month windows that hold the caller's estimate
-- of the ledger's now (wire.py ZONE_PARTS). Read only when a budget limits one of them.
local function zone_windows(zones)
  local out = {}
  for entry in string.gmatch(zones, '[^ ]+') do
    local z = unpack_zone(entry) or fail('BADARG', 'zones')
    z.day_start, z.day_end = int(z.day_start_ms, 'zones'), int(z.day_resets_at_ms, 'zones')
    z.week_start, z.week_end = int(z.week_start_ms, 'zones'), int(z.week_resets_at_ms, 'zones')
    z.month_start, z.month_end = int(z.month_start_ms, 'zones'), int(z.month_resets_at_ms, 'zones')
    out[z.timezone] = z
  end
  return out
end

local function leg_of(budget_id, window_key, ceiling, resets_at, allowance, user, velocity)
  return {budget_id = budget_id, window_key = window_key, ceiling_micros = ceiling,
          resets_at_ms = resets_at, outage_allowance_micros = allowance, user = user,
          velocity = velocity}
end

-- The legs of one budget's limits (each period's ceiling, nil where it has none) in its time
-- zone's windows `z` (nil: it limits no windowed period), and its rate (`rpm`, `cmax`: nil for
-- none) in legs.limits. A user's legs are flagged `user`; a velocity-watched budget's,
-- `velocity`.
local function add_legs(legs, z, budget_id, allowance, day, week, month, total, user, velocity,
                        rpm, cmax)
  local first = #legs + 1
  if day then
    legs[#legs + 1] = leg_of(budget_id, z.day_window_key, day, z.day_resets_at_ms, allowance,
                             user, velocity)
  end
  if week then
    legs[#legs + 1] = leg_of(budget_id, z.week_window_key, week, z.week_resets_at_ms, allowance,
                             user, velocity)
  end
  if month then
    legs[#legs + 1] = leg_of(budget_id, z.month_window_key, month, z.month_resets_at_ms,
                             allowance, user, velocity)
  end
  if total then
    legs[#legs + 1] = leg_of(budget_id, 'total', total, '0', allowance, user, velocity)
  end
  if cmax then
    legs[first].slot = true  -- the leg that holds the call's concurrency slot
  end
  if rpm or cmax then
    legs.limits = legs.limits or {}
    legs.limits[#legs.limits + 1] = {budget_id = budget_id, rpm = rpm, cmax = cmax}
  end
end

-- A rate as a definition keeps it (wire.py rate_field): requests per minute and concurrent calls,
-- nil for none.
local function parse_rate(rpm, cmax)
  rpm, cmax = tonumber(rpm), tonumber(cmax)
  return rpm ~= 0 and rpm or nil, cmax ~= 0 and cmax or nil
end

-- A call's model as reserve and book take it: a model's one name (core/budgets.py
-- is_model_name) or UNLISTED_MODEL (a status read's may be ALL_MODELS). Checked where a budget
-- with models reads it, before anything is written: a call under no such budget pays nothing
-- for it.
local function check_model(a)
  if a.model ~= UNLISTED_MODEL and not (a.reading and a.model == ALL_MODELS)
      and (#a.model > MODEL_ONE_NAME_LEN_MAX or not string.find(a.model, '^[%w._:@+/-]+$')) then
    fail('BADARG', 'model')
  end
end

local function ceiling_of(c)
  return c ~= '-' and c or nil
end

-- Whether a window of the periods given (a ceiling, or nil) does not hold `now`, in the zone's
-- windows `z`: the caller's windows were made for another time.
-- Whether a definition's rate field carries the models flag (wire.py rate_field): what a put,
-- a restore and a reserve read a definition's models by.
local function has_models(rate)
  return rate ~= nil and string.sub(rate, -#MODELS_FLAG - 1) == ' ' .. MODELS_FLAG
end

local function outside(z, now, day, week, month)
  return (day and (now < z.day_start or now >= z.day_end))
    or (week and (now < z.week_start or now >= z.week_end))
    or (month and (now < z.month_start or now >= z.month_end))
end

-- A budget's per_model limits the call's model has (a.model: its one name), or every model's
-- for a status read of ALL_MODELS, from the definition's per_model field (wire.py
-- per_model_field: ' <model>|day|week|month|total' per model, '-' for a period it does not
-- limit): {model, day, week, month, total} each, the ceilings nil where there are none; and
-- whether any of them limits a windowed period. A model's entry is found by one plain search.
local PER_MODEL_CEILINGS = '^ ([^|]+)|([%d-]+)|([%d-]+)|([%d-]+)|([%d-]+)'

local function model_limits(per_model, model)
  local out, windowed = {}, false
  local at = model == ALL_MODELS and 1 or string.find(per_model, ' ' .. model .. '|', 1, true)
  while at do
    local name, day, week, month, total = string.match(per_model, PER_MODEL_CEILINGS, at)
    if not name then
      break
    end
    day, week, month = ceiling_of(day), ceiling_of(week), ceiling_of(month)
    out[#out + 1] = {model = name, day = day, week = week, month = month,
                     total = ceiling_of(total)}
    windowed = windowed or (day or week or month) ~= nil
    at = model == ALL_MODELS and string.find(per_model, ' ', at + 1, true) or nil
  end
  return out, windowed
end

-- The legs of a call at `now`: every period of every budget on its path that is defined
-- ('sc:{TAG}:def:<budget_id>'; one that is not does not apply), day, week, month, then total;
-- after a budget with per_user limits, its end user's ('<budget>/user:<user>') when the call
-- names one; then its run's budget, which has one 'total' limit given inline and no definition.
-- Returns the legs, or a status table to return as is: {'ledger_reset'} when a definition was
-- put under another ledger; {'timezone', budget_id, timezone} when the caller sent no windows for
-- a zone a budget is in; {'clock', now} when the windows sent do not hold the ledger's now;
-- {'user_required', budget_id} when a budget needs a user and the call names none, and
-- {'model_not_allowed', budget_id} when a budget's models.allow does not name the call's model
-- (a.model; '' for a call its caller priced, which names none), unless a.reading (a status
-- read, a booking of what was admitted already). After a budget's own legs and its user's, its
-- calls of the model's ('<budget>/model:<model>') when its per_model limits name the model. A
-- budget with either setting says so in its rate (wire.py MODELS_FLAG), and only then are they
-- read. The run's ceiling is checked here, before anything is written. The third value is the
-- first budget on the path a velocity alarm paused, or nil; reserve refuses it, a status read
-- shows it.
-- legs.limits lists the budgets (a user's too) with a rate: {budget_id, rpm, cmax}; legs.users
-- the users this call would make: {key (the budget's users set), user, users_max, budget_id};
-- each nil when there are none.
local function resolve_legs(prefix, a, now)
  local legs, zones, paused_id = {}, nil, nil
  for budget_id in string.gmatch(a.budget_ids, '[^ ]+') do
    local key = prefix .. DEFINITION_KEY .. budget_id
    local ledger, timezone, allowance, day, month, total, paused, week, rate, per_user, velocity =
      read_definition(key)
    paused_id = paused_id or (paused and budget_id)
    if timezone then
      if ledger ~= a.ledger_id and ledger ~= a.ledger_id .. MODELS_LEDGER_SUFFIX then
        return nil, {'ledger_reset'}
      end
      allowance = allowance or '0'
      local users_max, required, u_rpm, u_cmax, u_day, u_week, u_month, u_total
      if per_user and per_user ~= '' then
        users_max, required, u_rpm, u_cmax, u_day, u_week, u_month, u_total =
          string.match(per_user, '^(%d+) ([01]) (%d+) (%d+) ([%d-]+) ([%d-]+) ([%d-]+) ([%d-]+)$')
        u_day, u_week, u_month = ceiling_of(u_day), ceiling_of(u_week), ceiling_of(u_month)
      end
      local rpm, cmax, models, windowed
      if rate then
        local flag
        rpm, cmax, flag = string.match(rate, '^(%d+) (%d+)(.*)$')
        rpm, cmax = parse_rate(rpm, cmax)
        if flag ~= '' and a.model ~= '' then
          check_model(a)
          local allow, per_model = unpack(redis.call('HMGET', key, MODEL_DEFINITION_FIELDS[1],
                                                     MODEL_DEFINITION_FIELDS[2]))
          if allow and not a.reading and a.model ~= ALL_MODELS
              and not string.find(allow, ' ' .. a.model .. ' ', 1, true) then
            return nil, {'model_not_allowed', budget_id}
          end
          if per_model then
            models, windowed = model_limits(per_model, a.model)
          end
        end
      end
      local z
      if day or week or month or (users_max and (u_day or u_week or u_month)) or windowed then
        zones = zones or zone_windows(a.zones)
        z = zones[timezone]
        if z == nil then
          return nil, {'timezone', budget_id, timezone}
        end
        if outside(z, now, day, week, month) then
          return nil, {'clock', now}
        end
      end
      add_legs(legs, z, budget_id, allowance, day, week, month, total, nil,
               velocity and velocity ~= '', rpm, cmax)
      if users_max then
        if a.user == '' then
          if required == '1' and not a.reading then
            return nil, {'user_required', budget_id}
          end
        else
          -- A user's windows are its budget's: checked above for the budget's own periods.
          if z and outside(z, now, u_day, u_week, u_month) then
            return nil, {'clock', now}
          end
          u_rpm, u_cmax = parse_rate(u_rpm, u_cmax)
          add_legs(legs, z, budget_id .. '/user:' .. a.user, allowance, u_day, u_week, u_month,
                   ceiling_of(u_total), true, false, u_rpm, u_cmax)
          legs.users = legs.users or {}
          legs.users[#legs.users + 1] = {key = prefix .. USERS_KEY .. budget_id,
                                         pending = prefix .. PENDING_USERS_KEY .. budget_id,
                                         user = a.user, users_max = tonumber(users_max),
                                         budget_id = budget_id}
        end
      end
      if models then
        for _, m in ipairs(models) do
          if z and outside(z, now, m.day, m.week, m.month) then
            return nil, {'clock', now}
          end
          local first = #legs + 1
          add_legs(legs, z, budget_id .. '/model:' .. m.model, allowance, m.day, m.week,
                   m.month, m.total, nil, false, nil, nil)
          for i = first, #legs do
            legs[i].model = true
          end
        end
      end
    end
  end
  if a.run ~= '' then
    local budget_id, ceiling = string.match(a.run, '^(%S+) (%S+)$')
    int(ceiling, 'run')
    legs[#legs + 1] = {budget_id = budget_id, window_key = 'total', ceiling_micros = ceiling,
                       resets_at_ms = '0', outage_allowance_micros = '0', run = true}
  end
  return legs, nil, paused_id
end

-- The users a hold would make that a budget has no room for: {'users_exhausted', budget_id}, or
-- nil. A budget's places are taken by its charged users (the users set, for good: a call of
-- theirs was charged) and by users with a call open and none charged yet (the pending set): a
-- pending place is given back when its user's calls have all ended uncharged (user_leg_moved),
-- so calls that were released cannot use the places up, and a lease that ends is resolved by
-- expiry (which a refused reserve runs first: reserve.lua), charged or not, like any other.
-- A user already in either set passes (u.known: a charged one).
local function users_refusal(users)
  for _, u in ipairs(users) do
    if redis.call('ZSCORE', u.key, u.user) then
      u.known = true
    elseif not redis.call('ZSCORE', u.pending, u.user)
        and redis.call('ZCARD', u.key) + redis.call('ZCARD', u.pending) >= u.users_max then
      return {'users_exhausted', u.budget_id}
    end
  end
  return nil
end

-- A budget's rate or concurrency limit that a new call would pass: {'rate_limited' |
-- 'concurrency_limited', budget_id, retry_after_s}, or nil. The rate's log drops the calls
-- older than its window here.
local function rate_refusal(prefix, limits, now)
  for _, lim in ipairs(limits) do
    if lim.rpm then
      local key = prefix .. RATE_KEY .. lim.budget_id
      redis.call('ZREMRANGEBYSCORE', key, '-inf', istr(now - RATE_WINDOW_MS))
      if redis.call('ZCARD', key) >= lim.rpm then
        local oldest = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
        return {'rate_limited', lim.budget_id,
                istr(math.max(1, math.ceil((tonumber(oldest[2]) + RATE_WINDOW_MS - now) / 1000)))}
      end
    end
    if lim.cmax then
      local key = prefix .. CONCURRENCY_KEY .. lim.budget_id
      redis.call('ZREMRANGEBYSCORE', key, '-inf', istr(now))
      if redis.call('ZCARD', key) >= lim.cmax then
        -- The earliest lease end among the held slots: by then a slot is free for certain
        -- (expiry frees it if nothing ends the call sooner), so a client that obeys asks
        -- once, not once a second for as long as a call of unknown outcome holds its slot.
        local first = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
        return {'concurrency_limited', lim.budget_id,
                istr(math.max(CONCURRENCY_RETRY_AFTER_S_MIN,
                              math.ceil((tonumber(first[2]) - now) / 1000)))}
      end
    end
  end
  return nil
end

-- What a hold counts once it is made: each rate's call, each concurrency slot, each new user.
local function count_hold(prefix, legs, rid, now, expires_at)
  for _, lim in ipairs(legs.limits or {}) do
    if lim.rpm then
      local key = prefix .. RATE_KEY .. lim.budget_id
      redis.call('ZADD', key, istr(now), rid)
      redis.call('PEXPIRE', key, istr(RATE_WINDOW_MS))
    end
  end
  for _, leg in ipairs(legs) do
    if leg.slot then
      redis.call('ZADD', prefix .. CONCURRENCY_KEY .. leg.budget_id, expires_at, rid)
    end
  end
  for _, u in ipairs(legs.users or {}) do
    if not u.known then
      redis.call('ZADD', u.pending, '0', u.user)
    end
  end
end

-- reserve.lua's hold of `held` micros in every leg, if each has room, the key's quota has room
-- for what the hold makes it keep, and no reservation is under KEYS[2] (a's fields are reserve's
-- arguments): its answer. Otherwise nil, and the first leg that refuses with why ('exceeded':
-- its spend leaves no room; 'busy': open holds do), or the quota's refusal with why 'quota', or
-- nothing when a reservation is already under this id.
local function hold(prefix, KEYS, legs, a, held, ttl, now, now_text)
  local exceeded, busy, opens = nil, nil, 0
  for _, leg in ipairs(legs) do
    local key = prefix .. COUNTER_KEY .. leg.budget_id .. '|' .. leg.window_key
    if leg.run and run_stale(key, now) then
      redis.call('DEL', key)  -- an idle run's counter Redis has not dropped yet: a new run
    end
    local c = redis.call('HMGET', key, 'committed', 'reserved', 'overshoot')
    leg.key, leg.committed, leg.reserved, leg.overshoot = key, c[1] or '0', c[2] or '0', c[3] or '0'
    local ceiling, committed = tonumber(leg.ceiling_micros), tonumber(leg.committed)
    if committed + held > ceiling then
      exceeded = exceeded or leg
    elseif committed + tonumber(leg.reserved) + held > ceiling then
      busy = busy or leg
    end
    if leg.run and c[1] == false and c[2] == false then
      opens = 1  -- a run's first call opens its counter (one with nothing in it is not kept)
    end
  end
  if exceeded or busy then
    return nil, exceeded or busy, exceeded and 'exceeded' or 'busy'
  end
  -- The key's quota of what outlives the call: a record kept past a resend (counted by the
  -- records window; one kept a day for an Idempotency-Key, by the day), a run it opens. A
  -- gateway call without either (the hot path) reads no quota.
  local kept = a.retention_ms ~= RESEND_WINDOW_MS_TEXT
  local keyed = kept and tonumber(a.retention_ms) > REPLAY_WINDOW_MS
  local recent = kept and not keyed
  local qkey, used
  if kept or opens > 0 then
    qkey = prefix .. QUOTA_KEY .. a.owner
    used = quota_read(qkey, now)
    local over = (recent and used.recent >= RECORDS_PER_KEY_PER_WINDOW_MAX and 'recent')
      or (keyed and used.records >= IDEMPOTENT_RECORDS_PER_KEY_MAX and 'records')
      or (used.runs + opens > RUNS_PER_KEY_MAX and 'runs')
    if over then
      if redis.call('EXISTS', KEYS[2]) == 1 then
        return nil  -- a replay, answered as one
      end
      return nil, quota_refusal(over, used, now), 'quota'
    end
  end
  -- End users, rates and concurrency: read only for budgets that have them.
  local limited = (legs.users and users_refusal(legs.users))
    or (legs.limits and rate_refusal(prefix, legs.limits, now))
  if limited then
    if redis.call('EXISTS', KEYS[2]) == 1 then
      return nil  -- a replay, answered as one
    end
    return nil, limited, 'limit'
  end
  local state, outcome, reserved = reserve_effects('absent', a.expire_policy, held, 0)
  local expires_at = istr(now + ttl)
  if not redis.call('SET', KEYS[2], pack_opened(
      state, a.reserved_micros, a.expire_policy, a.retention_ms, a.owner, encode_legs(legs),
      expires_at, now_text, outcome, a.record_tail),
      -- Expiry resolves the lease long before this (and keeps the record from then on); this
      -- bounds a record that nothing ever resolves, an unknown outcome.
      'PX', istr(ttl + UNKNOWN_OUTCOME_RETENTION_MS), 'NX') then
    return nil
  end
  local out = {'ok', now}
  local delta = text_of(reserved, held, a.reserved_micros, 0, '0')
  local opened = opens > 0
  for _, leg in ipairs(legs) do
    redis.call('HINCRBY', leg.key, 'reserved', delta)
    if leg.run then
      touch_run(prefix, leg.key, now)
    elseif leg.committed == '0' and leg.reserved == '0' and leg.window_key ~= 'total' then
      -- a window's first hold: its counter goes COUNTER_RETENTION_MS after the window ends
      keep_window(prefix, leg.key, leg.resets_at_ms)
      opened = true
    end
    out[#out + 1] = leg_status(leg, leg.committed, istr(tonumber(leg.reserved) + reserved),
                               leg.overshoot)
  end
  redis.call('ZADD', KEYS[3], expires_at, id_of(prefix, KEYS[2]))
  if opened then
    sweep_counters(prefix, now)  -- as often as the tag makes counters
  end
  if legs.users or legs.limits then
    count_hold(prefix, legs, id_of(prefix, KEYS[2]), now, expires_at)
  end
  if qkey then
    used.recent = used.recent + (recent and 1 or 0)
    used.records = used.records + (keyed and 1 or 0)
    used.runs = used.runs + opens
    quota_write(qkey, used)
  end
  -- Last: the tag's reserve sequence, which only grows; an instance that reads one at or below
  -- one it was answered before knows the ledger went back in time (core/stores/scripted.py).
  out[#out + 1] = redis.call('HINCRBY', KEYS[1], 'seq', 1)
  return out
end

-- An idempotency key's state: 'state' ('in_flight' | 'done'), 'fingerprint', 'token'.
local function reply_state(key)
  local r = redis.call('HMGET', key, 'state', 'fingerprint', 'token')
  return {state = r[1], fingerprint = r[2], token = r[3]}
end
