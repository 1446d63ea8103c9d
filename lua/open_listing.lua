-- open_listing: a tag's open reservations as an operator lists them (the spend page), read at
-- one instant.
--
-- KEYS[1] meta hash 'sc:{TAG}:meta'   KEYS[2] the tag's open leases 'sc:{TAG}:open'
-- ARGV: listed_max (reservations listed of each kind, >= 1), examined_max (open reservations
--       whose runs are read, those with the latest lease ends, >= 1), [now_ms]
-- Returns {now_ms, open_count, overdue_count, overdue, within_lease, runs}: `overdue` (lease
-- ended: an unknown outcome until expiry books it) and `within_lease`, each {id, record
-- (wire.py RECORD_FIELDS, packed), ...} by lease end, earliest first; `runs` {budget_id,
-- ceiling_micros, committed_micros, reserved_micros, seen_ms, ...}, each run once.
-- Why: the open-lease set is the ledger's only index of what is held, and a run's counter is
-- found only through the legs of a call that holds in it: reserve and settle keep no list of
-- runs, and this adds no write to them. Reads only (an idle run's counter is left for Redis to
-- drop, as status.lua leaves it), so it is safe to run twice; every key is under the one tag.
local listed_max, examined_max = int(ARGV[1], 'listed_max'), int(ARGV[2], 'examined_max')
if listed_max < 1 or examined_max < 1 then
  fail('BADARG', 'listed_max, examined_max')
end
local now = ledger_now(ARGV[3])
local prefix = prefix_of(KEYS[1])
local now_text = istr(now)

local function open_record(rid)
  local rec = load_record(prefix .. RECORD_KEY .. rid)
  if rec and rec.state == 'open' then
    return rec
  end
  return nil  -- resolved since, or gone: expiry takes its id off the set
end

local function listed(ids)
  local out = {}
  for _, rid in ipairs(ids) do
    local rec = open_record(rid)
    if rec then
      out[#out + 1] = rid
      out[#out + 1] = pack_record(rec)
    end
  end
  return out
end

local runs, seen = {}, {}
for _, rid in ipairs(redis.call('ZREVRANGE', KEYS[2], '0', istr(examined_max - 1))) do
  local rec = open_record(rid)
  for _, leg in ipairs(rec and parse_legs(rec.legs) or {}) do
    local ck = counter_key(prefix, leg)
    if leg.run and not seen[ck] then
      seen[ck] = true
      if not run_stale(ck, now) and redis.call('EXISTS', ck) == 1 then
        local c = redis.call('HMGET', ck, 'committed', 'reserved', 'seen')
        runs[#runs + 1] = leg.budget_id
        runs[#runs + 1] = leg.ceiling_micros
        runs[#runs + 1] = c[1] or '0'
        runs[#runs + 1] = c[2] or '0'
        runs[#runs + 1] = c[3] or ''
      end
    end
  end
end

local limit = {'LIMIT', '0', istr(listed_max)}
return {now_text, redis.call('ZCARD', KEYS[2]),
        redis.call('ZCOUNT', KEYS[2], '-inf', now_text),
        listed(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_text, unpack(limit))),
        listed(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now_text, '+inf', unpack(limit))),
        runs}
