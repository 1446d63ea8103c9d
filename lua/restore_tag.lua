-- restore_tag: one organisation of a ledger export, written whole under the restored ledger id.
--
-- KEYS[1] meta hash 'sc:{TAG}:meta'
-- ARGV: ledger_id, now_ms, force ('1' | '0'), counter_keep_ms (how long from now a window counter
--   of an export without its expiry is kept: core/stores/operations.py), mode ('restore' |
--   'restamp'), then four sections, each a count and its items:
--   definitions: budget_id, field count, (field, value) pairs; in 'restamp' mode no fields, and
--     the definition the ledger holds takes the ledger id
--   users: budget_id, member count, members (added to the budget's users set)
--   reservations: reservation_id, its record as charged (wire.py RECORD_FIELDS, packed),
--     held micros, committed delta, leg count, legs (counter suffix 'budget_id|window_key', and
--     its kind): an open one of the export, charged here; or one an expiry charged already
--     (held 0, delta 0, no legs: its charge is in the counters), kept for a late settle or a
--     correction
--   counters: suffix, kind, ttl_ms ('' for none), field count, (field, value) pairs
--   A counter's kind says which sweep index lists it: 'window' (a day, week or month window's:
--   WINDOWS), 'run' (RUNS) or 'total' (none: a budget's total is kept as long as the budget).
--   then, in 'restore' mode, the meta hash's (field, value) pairs to the end.
-- Returns {counters written, reservations charged as unknown here, the micros they held}.
-- Why one script: an organisation is restored whole or not at all, its counters with the charges
-- of its open reservations, so running it again (a restore cut short, with --force) neither
-- charges a reservation twice nor mixes two exports' counters. Everything is read before the first
-- write. A reservation the ledger holds already is booked in its counters as it stands and is not
-- charged again. A counter gets no expiry (an evicting Redis must find none to drop:
-- core/stores/keys.py WINDOWS) but goes into its tag's sweep index: a run's as written now, a
-- window's by the end of the expiry the export gave it or else counter_keep_ms from now. Under
-- force, a counter the ledger holds keeps the larger committed and overshoot of the two (never a
-- refill) and its own holds.
local prefix = prefix_of(KEYS[1])
local ledger_id, now, force, keep_ms, mode = ARGV[1], int(ARGV[2], 'now_ms'), ARGV[3] == '1',
  int(ARGV[4], 'counter_keep_ms'), ARGV[5]
if mode ~= 'restore' and mode ~= 'restamp' then fail('BADARG', 'mode') end
local at = 6
local function take()
  local v = ARGV[at]
  if v == nil then fail('BADARG', 'restore') end
  at = at + 1
  return v
end
local function count() return int(take(), 'count') end
local function bounded(n, name)
  if n > INT_MAX or n < -INT_MAX then fail('BADARG', name) end
  return n
end
local function signed(s, name)
  if #s > 17 or not string.find(s, '^%-?%d+$') then fail('BADARG', name) end
  return bounded(tonumber(s), name)
end
local KINDS = {window = true, run = true, total = true}
local function kind_of(s)
  if not KINDS[s] then fail('BADARG', 'kind') end
  return s
end
local function pairs_of(n)
  local out = {}
  for _ = 1, n do
    out[#out + 1] = take()
    out[#out + 1] = take()
  end
  return out
end

local definitions = {}
for _ = 1, count() do
  local budget_id = take()
  definitions[#definitions + 1] = {budget_id, pairs_of(count())}
end
local users = {}
for _ = 1, count() do
  local budget_id, members = take(), {}
  for _ = 1, count() do members[#members + 1] = take() end
  users[#users + 1] = {budget_id, members}
end
local records = {}
for _ = 1, count() do
  local r = {id = take(), packed = take(), held = int(take(), 'held'),
             delta = signed(take(), 'delta'), legs = {}}
  for _ = 1, count() do
    r.legs[#r.legs + 1] = {take(), kind_of(take())}
  end
  records[#records + 1] = r
end
local counters, exported = {}, {}
for _ = 1, count() do
  local suffix, kind, ttl = take(), kind_of(take()), take()
  local c = {suffix = suffix, kind = kind, ttl = ttl ~= '' and int(ttl, 'ttl_ms') or nil,
             fields = pairs_of(count())}
  counters[#counters + 1] = c
  exported[suffix] = c
end
local meta = mode == 'restore' and pairs_of((#ARGV - at + 1) / 2) or {}
if at ~= #ARGV + 1 then fail('BADARG', 'restore') end

-- Reads: the reservations the ledger holds already, and, under force, the counters it holds.
local deltas, kinds = {}, {}
for _, r in ipairs(records) do
  r.known = redis.call('EXISTS', prefix .. RECORD_KEY .. r.id) == 1
  if not r.known then
    for _, leg in ipairs(r.legs) do
      deltas[leg[1]] = (deltas[leg[1]] or 0) + r.delta
      kinds[leg[1]] = leg[2]
    end
  end
end
for suffix in pairs(deltas) do
  -- A run's counter the export did not have has ended: nothing to book its charge in.
  if not exported[suffix] and kinds[suffix] ~= 'run' then
    local c = {suffix = suffix, kind = kinds[suffix], fields = {}}
    counters[#counters + 1] = c
    exported[suffix] = c
  end
end
for _, c in ipairs(counters) do
  local v = {committed = 0, overshoot = 0}
  local rest = {}
  for i = 1, #c.fields, 2 do
    local field, value = c.fields[i], c.fields[i + 1]
    if field == 'committed' or field == 'overshoot' then
      v[field] = signed(value, field)
    elseif field ~= 'reserved' then
      rest[#rest + 1] = field
      rest[#rest + 1] = value
    end
  end
  v.committed = bounded(v.committed + (deltas[c.suffix] or 0), 'committed')
  -- Every hold the export recorded is charged above; any other the counter held was taken or
  -- resolved while the export read, and nothing in the restored ledger holds it.
  v.reserved = 0
  local key = prefix .. COUNTER_KEY .. c.suffix
  if force and redis.call('EXISTS', key) == 1 then
    local live = redis.call('HMGET', key, 'committed', 'reserved', 'overshoot')
    v.committed = math.max(v.committed, signed(live[1] or '0', 'committed'))
    v.reserved = signed(live[2] or '0', 'reserved')
    v.overshoot = math.max(v.overshoot, signed(live[3] or '0', 'overshoot'))
  end
  rest[#rest + 1] = 'committed'
  rest[#rest + 1] = istr(v.committed)
  rest[#rest + 1] = 'reserved'
  rest[#rest + 1] = istr(v.reserved)
  rest[#rest + 1] = 'overshoot'
  rest[#rest + 1] = istr(v.overshoot)
  c.write = rest
end

-- Writes.
if mode == 'restore' then
  redis.call('DEL', KEYS[1])
  if #meta > 0 then redis.call('HSET', KEYS[1], unpack(meta)) end
end
redis.call('HSET', KEYS[1], 'ledger', ledger_id)
for _, d in ipairs(definitions) do
  local key = prefix .. DEFINITION_KEY .. d[1]
  if mode == 'restore' then
    redis.call('DEL', key)
    if #d[2] > 0 then redis.call('HSET', key, unpack(d[2])) end
  end
  if redis.call('HEXISTS', key, 'timezone') == 1 then
    -- A definition with models keeps the suffix its rate's flag asks for (put_budget's).
    local flagged = has_models(redis.call('HGET', key, 'rate') or nil)
    redis.call('HSET', key, 'ledger', flagged and ledger_id .. MODELS_LEDGER_SUFFIX or ledger_id)
  end
end
-- A users set can hold USERS_MAX_MAX members: added a bounded batch a command.
local USERS_PER_COMMAND = 1000
for _, u in ipairs(users) do
  local key = prefix .. USERS_KEY .. u[1]
  for first = 1, #u[2], USERS_PER_COMMAND do
    local args = {}
    for i = first, math.min(first + USERS_PER_COMMAND - 1, #u[2]) do
      args[#args + 1] = '0'
      args[#args + 1] = u[2][i]
    end
    redis.call('ZADD', key, unpack(args))
  end
end
for _, c in ipairs(counters) do
  local key = prefix .. COUNTER_KEY .. c.suffix
  redis.call('DEL', key)
  redis.call('HSET', key, unpack(c.write))
  -- The sweep indexes list a counter by its key after the prefix (lua/lib.lua sweep_counters).
  if c.kind == 'window' then
    redis.call('ZADD', prefix .. WINDOWS_KEY, istr(now + (c.ttl or keep_ms)),
               COUNTER_KEY .. c.suffix)
  elseif c.kind == 'run' then
    redis.call('ZADD', prefix .. RUNS_KEY, istr(now), COUNTER_KEY .. c.suffix)
  end
end
local charged, charged_micros = 0, 0
for _, r in ipairs(records) do
  if not r.known then
    redis.call('SET', prefix .. RECORD_KEY .. r.id, r.packed, 'PX',
               istr(UNKNOWN_OUTCOME_RETENTION_MS))
    if r.held > 0 then
      charged = charged + 1
      charged_micros = charged_micros + r.held
    end
  end
end
return {#counters, charged, istr(charged_micros)}
