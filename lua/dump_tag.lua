-- dump_tag: one page of a tag's budgets, counters and end users as they are kept, for an export.
--
-- KEYS[1] meta hash 'sc:{TAG}:meta'
-- ARGV: cursor (SCAN's, '0' to start), count (keys one page scans)
-- Returns {next_cursor, entry...}, each entry {'hash', suffix, pttl_ms, field, value, ...}: the
-- meta hash, a definition or a counter (an end user's too); or {'users' | 'pending_users',
-- suffix, pttl_ms}: a budget's users set or pending users set, whose members the caller reads
-- apart; or {'unknown', suffix, pttl_ms, record}: a reservation an expiry charged as unknown,
-- packed (wire.py RECORD_FIELDS), which a late settle or an operator's correction may still
-- lower. suffix is the key after 'sc:{TAG}:'. Next cursor '0': done.
-- Why: an export must find every period window a budget has counters in, and the scripts keep
-- no list of them; SCAN with the tag's prefix reads them where they are, on the node that holds
-- the tag's slot (this script runs there), a bounded page per call. A users set can hold as many
-- members as its budget's users_max (core/limits.py USERS_MAX_MAX), so a page names it and the
-- caller pages through its members (core/stores/operations.py dump_tag). Rate logs and
-- concurrency counts are not read: they count the open reservations and the last minute's
-- calls, and a restore brings back no open reservation (each is charged as unknown) and starts
-- every rate afresh. Open reservations are read apart (the open-lease set, then read.lua):
-- core/stores/operations.py dump_tag says in which order, and why. Reads only.
local cursor, count = ARGV[1], int(ARGV[2], 'count')
local prefix = prefix_of(KEYS[1])
local page = redis.call('SCAN', cursor, 'MATCH', prefix .. '*', 'COUNT', istr(count))
local out = {page[1]}
for _, key in ipairs(page[2]) do
  local suffix = string.sub(key, #prefix + 1)
  if suffix == META_KEY or string.sub(suffix, 1, #DEFINITION_KEY) == DEFINITION_KEY
      or string.sub(suffix, 1, #COUNTER_KEY) == COUNTER_KEY then
    local entry = {'hash', suffix, redis.call('PTTL', key)}
    for _, v in ipairs(redis.call('HGETALL', key)) do
      entry[#entry + 1] = v
    end
    out[#out + 1] = entry
  elseif string.sub(suffix, 1, #USERS_KEY) == USERS_KEY then
    out[#out + 1] = {'users', suffix, redis.call('PTTL', key)}
  elseif string.sub(suffix, 1, #RECORD_KEY) == RECORD_KEY then
    local packed = redis.call('GET', key)
    local r = packed and unpack_record(packed)
    if r and r.state == 'expired' and r.outcome == 'unknown' then
      out[#out + 1] = {'unknown', suffix, redis.call('PTTL', key), packed}
    end
  elseif string.sub(suffix, 1, #PENDING_USERS_KEY) == PENDING_USERS_KEY then
    -- users with a call open and none charged: a restore charges their calls as unknown, so
    -- each takes its place among the budget's users there
    out[#out + 1] = {'pending_users', suffix, redis.call('PTTL', key)}
  end
end
return out
