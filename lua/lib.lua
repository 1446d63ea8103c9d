-- Shared prelude, prepended to every ledger script when it is loaded (core/stores/scripts.py).
--
-- Conventions every script follows:
--   * Money is integer micro-dollars. Lua numbers are doubles, exact below 2**53, so every
--     integer argument is checked against INT_MAX before use.
--   * Numbers are written back with istr() (string.format '%d'), never tostring(): Lua 5.1's
--     tostring keeps 14 significant digits and prints 1.7000000000001e+15.
--   * All argument checks run before the first write: a Lua error does not roll back writes
--     that came before it.
--   * KEYS[1] is the tag's meta hash 'sc:{TAG}:meta'. Every other key a script touches is built
--     from the same 'sc:{TAG}:' prefix, so all of them hash to one slot and the scripts run
--     unchanged on Redis Cluster.
--   * Time is the ledger's: Redis TIME, unless the store passes an explicit now_ms (tests that
--     inject a clock; production passes '').

local INT_MAX = 9007199254740991

local function fail(code, detail)
  error({err = code .. ' ' .. detail})
end

local function int(s, name)
  if type(s) ~= 'string' or #s == 0 or #s > 16 or not string.match(s, '^%d+$') then
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

local function prefix_of(meta_key)
  return string.sub(meta_key, 1, #meta_key - 4)
end

local function ledger_now(arg)
  if arg ~= '' then
    return int(arg, 'now_ms')
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The ledger id is written into each tag's meta hash when its first budget is put. A missing or
-- different id means the data this instance enforced against is gone (flushed, restarted
-- without persistence, or replaced), and enforcing now would serve a refilled budget.
local function ledger_matches(meta_key, ledger_id)
  return redis.call('HGET', meta_key, 'ledger') == ledger_id
end

local function split(s, sep)
  local out = {}
  for part in string.gmatch(s, '([^' .. sep .. ']+)') do
    out[#out + 1] = part
  end
  return out
end

-- A leg is one (budget, period window) pair a reservation holds money in, stored on the
-- reservation as 'budget_id|window_key|ceiling|window_end_ms|allowance', with '|run' after it for
-- a run's leg (ids never contain '|' or ' '; core/budgets.py enforces it). The numeric parts are
-- kept as the strings they arrived as, never re-formatted. Legs stored before runs were marked
-- have five parts and count as budgets' legs.
local function parse_legs(s)
  local legs = {}
  for _, raw in ipairs(split(s, ' ')) do
    local f = split(raw, '|')
    legs[#legs + 1] = {bid = f[1], wkey = f[2], ceil = f[3], wend = f[4], allow = f[5],
                       run = f[6] == 'run'}
  end
  return legs
end

local function counter_key(prefix, leg)
  return prefix .. 'p:' .. leg.bid .. '|' .. leg.wkey
end

-- A run's counter lives while its run is active. Every write to it stamps the ledger's time in
-- its 'seen' field and sets its expiry run_idle_ms from then (core/limits.py RUN_COUNTER_IDLE_MS),
-- so Redis drops it after that long without a call, and a counter 'seen' that long ago counts as
-- gone even before Redis drops it (the same instant under Redis TIME; under a test's injected
-- clock, the only one). A counter written before runs expired has no 'seen' and lives until its
-- next write stamps it.
local function run_stale(ck, now, idle_ms)
  local seen = redis.call('HGET', ck, 'seen')
  return seen and tonumber(seen) + idle_ms <= now
end

local function touch_run(ck, now, idle_ms)
  redis.call('HSET', ck, 'seen', istr(now))
  redis.call('PEXPIRE', ck, istr(idle_ms))
end

-- Whether a settle, release or expiry may write to a leg's counter: a budget's always; a run's
-- only while it lives. A run that went idle is over, and writing to its gone counter would
-- recreate it holding only this call's delta (a negative balance for a refund).
local function writable(ck, leg, now, idle_ms)
  if not leg.run then
    return true
  end
  if run_stale(ck, now, idle_ms) then
    redis.call('DEL', ck)
    return false
  end
  return redis.call('EXISTS', ck) == 1
end

local function touched(ck, leg, now, idle_ms)
  if leg.run then
    touch_run(ck, now, idle_ms)
  end
end

local function hincr(key, field, delta)
  if delta ~= 0 then
    redis.call('HINCRBY', key, field, istr(delta))
  end
end

local function counters(key)
  local v = redis.call('HMGET', key, 'committed', 'reserved', 'overshoot')
  return tonumber(v[1] or '0'), tonumber(v[2] or '0'), tonumber(v[3] or '0')
end

-- Expiry of one lease. The policy was chosen when the lease was taken and is stored on it:
-- 'charge' books the reserved amount as committed with outcome 'unknown' (a worker that died may
-- have been billed by the provider); 'release' returns it to the budget.
local function expire_one(prefix, open_key, rid, now, retention_ms, idle_ms)
  local rkey = prefix .. 'r:' .. rid
  local r = redis.call('HMGET', rkey, 'st', 'amt', 'legs', 'pol')
  if r[1] ~= 'o' then
    redis.call('ZREM', open_key, rid)
    return 0
  end
  local amt = tonumber(r[2])
  for _, leg in ipairs(parse_legs(r[3])) do
    local ck = counter_key(prefix, leg)
    if writable(ck, leg, now, idle_ms) then
      hincr(ck, 'reserved', 0 - amt)
      if r[4] == 'charge' then
        hincr(ck, 'committed', amt)
      end
      touched(ck, leg, now, idle_ms)
    end
  end
  if r[4] == 'charge' then
    redis.call('HSET', rkey, 'st', 'x', 'outcome', 'unknown', 'resolved_ms', istr(now))
  else
    redis.call('HSET', rkey, 'st', 'x', 'outcome', 'released', 'resolved_ms', istr(now))
  end
  redis.call('PEXPIRE', rkey, istr(retention_ms))
  redis.call('ZREM', open_key, rid)
  return 1
end

local function reclaim(prefix, open_key, now, batch_max, retention_ms, idle_ms)
  local ids = redis.call('ZRANGEBYSCORE', open_key, '-inf', istr(now), 'LIMIT', 0, istr(batch_max))
  local n = 0
  for _, rid in ipairs(ids) do
    n = n + expire_one(prefix, open_key, rid, now, retention_ms, idle_ms)
  end
  return n
end

-- What a resolved reservation charged: its settled amount; expiry's hold for an outcome
-- 'unknown'; nothing once released.
local function charged_of(st, outcome, amt, charged)
  if st == 's' then
    return tonumber(charged)
  end
  if st == 'x' and outcome == 'unknown' then
    return tonumber(amt)
  end
  return 0
end

-- Settle one reservation that is open or expired ('o' or 'x') at actual (a checked integer,
-- given as the string it arrived as), recording `outcome` and `extra` (field, value pairs).
-- Shared by settle (an owner's) and correct (an operator's), so both book alike. Under the
-- 'charge' policy an expired lease's hold sits in committed and is swapped for the actual; under
-- 'release' nothing is held, so the whole actual is charged and counted as overshoot.
local function settle_one(prefix, rkey, open_key, rid, st, amt_s, legs_s, pol, actual_s, now,
                          retention_ms, idle_ms, outcome, extra)
  local actual, amt = tonumber(actual_s), tonumber(amt_s)
  local held, committed_delta, reserved_delta, late = amt, actual, 0 - amt, 0
  if st == 'x' then
    late = 1
    reserved_delta = 0
    if pol == 'charge' then
      committed_delta = actual - amt
    else
      held = 0
    end
  end
  local overshoot = math.max(0, actual - held)
  local released = math.max(0, held - actual)
  for _, leg in ipairs(parse_legs(legs_s)) do
    local ck = counter_key(prefix, leg)
    if writable(ck, leg, now, idle_ms) then
      hincr(ck, 'reserved', reserved_delta)
      hincr(ck, 'committed', committed_delta)
      hincr(ck, 'overshoot', overshoot)
      touched(ck, leg, now, idle_ms)
    end
  end
  local fields = {'st', 's', 'act', actual_s, 'charged', actual_s, 'rel', istr(released),
                  'over', istr(overshoot), 'late', istr(late), 'outcome', outcome,
                  'resolved_ms', istr(now)}
  for _, v in ipairs(extra) do
    fields[#fields + 1] = v
  end
  redis.call('HSET', rkey, unpack(fields))
  redis.call('PEXPIRE', rkey, istr(retention_ms))
  redis.call('ZREM', open_key, rid)
  return {'ok', actual, released, overshoot, late, 0}
end

-- Period windows are computed by the caller (time zones need a tz database, Lua has none) for the
-- ledger time it expects: ARGV from position i holds a count of time zones, then per zone its
-- name, a count of windows and (key, start_ms, end_ms) triples. The script picks the window that
-- contains the ledger's own now; none does only if the caller's estimate was off by a whole
-- period, and the caller then retries with the now this script returns.
local function parse_windows(argv, i)
  local zones = {}
  local nz = int(argv[i], 'zones')
  i = i + 1
  for _ = 1, nz do
    local tz = argv[i]
    local nw = int(argv[i + 1], 'windows')
    i = i + 2
    local ws = {}
    for _ = 1, nw do
      ws[#ws + 1] = {key = argv[i], start = int(argv[i + 1], 'start_ms'),
                     finish = int(argv[i + 2], 'end_ms'), finish_s = argv[i + 2]}
      i = i + 3
    end
    zones[tz] = ws
  end
  return zones, i
end

local function pick_window(zones, tz, period, now)
  local ws = zones[tz]
  if ws == nil then
    return nil
  end
  local want = period .. ':'
  for _, w in ipairs(ws) do
    if string.sub(w.key, 1, #want) == want and w.start <= now and now < w.finish then
      return w
    end
  end
  return nil
end

local PERIODS = {'day', 'month', 'total'}

-- Budget entries from ARGV position i: a count, then per budget (budget_id, assumed tz,
-- inline ceiling or ''). A budget with an inline ceiling (a run budget) has one 'total' limit and
-- no definition in the ledger; the others are read from 'sc:{TAG}:def:<budget_id>', and a budget
-- on the path with no definition does not apply. Returns the legs, or a status table to return
-- as is ({'tz', budget_id, tz} when the caller assumed the wrong zone; {'clock', now} when no
-- window fits).
local function resolve_legs(prefix, argv, i, zones, now)
  local nb = int(argv[i], 'budgets')
  i = i + 1
  local legs = {}
  for _ = 1, nb do
    local bid, tz, inline = argv[i], argv[i + 1], argv[i + 2]
    i = i + 3
    if inline ~= '' then
      int(inline, 'run_ceiling_micros')
      legs[#legs + 1] = {bid = bid, period = 'total', wkey = 'total', ceil = inline,
                         wend = '0', allow = '0', run = true}
    else
      local d = redis.call('HMGET', prefix .. 'def:' .. bid,
                           'tz', 'allow', 'ceil:day', 'ceil:month', 'ceil:total')
      if d[1] then
        if d[1] ~= tz then
          return nil, {'tz', bid, d[1]}
        end
        local ceils = {day = d[3], month = d[4], total = d[5]}
        for _, p in ipairs(PERIODS) do
          if ceils[p] then
            local wkey, wend = 'total', '0'
            if p ~= 'total' then
              local w = pick_window(zones, tz, p, now)
              if w == nil then
                return nil, {'clock', now}
              end
              wkey, wend = w.key, w.finish_s
            end
            legs[#legs + 1] = {bid = bid, period = p, wkey = wkey, ceil = ceils[p],
                               wend = wend, allow = d[2] or '0'}
          end
        end
      end
    end
  end
  return legs, nil
end

local function encode_legs(legs)
  local parts = {}
  for _, l in ipairs(legs) do
    local part = l.bid .. '|' .. l.wkey .. '|' .. l.ceil .. '|' .. l.wend .. '|' .. l.allow
    if l.run then
      part = part .. '|run'
    end
    parts[#parts + 1] = part
  end
  return table.concat(parts, ' ')
end

-- Flat status of each leg as the scripts return it:
-- budget_id, window_key, ceiling, committed, reserved, overshoot, window_end_ms, allowance.
-- A leg marked `gone` (a run that went idle, not yet dropped) reads as empty.
local function leg_status(prefix, legs)
  local out = {}
  for _, l in ipairs(legs) do
    local c, r, o = 0, 0, 0
    if not l.gone then
      c, r, o = counters(counter_key(prefix, l))
    end
    out[#out + 1] = l.bid
    out[#out + 1] = l.wkey
    out[#out + 1] = tonumber(l.ceil)
    out[#out + 1] = c
    out[#out + 1] = r
    out[#out + 1] = o
    out[#out + 1] = tonumber(l.wend)
    out[#out + 1] = tonumber(l.allow)
  end
  return out
end

local function append(dst, src)
  for _, v in ipairs(src) do
    dst[#dst + 1] = v
  end
  return dst
end
