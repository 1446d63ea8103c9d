-- dump_tag: one page of a tag's budgets, counters and open leases as they are kept, for an export.
--
-- KEYS[1] meta hash 'sc:{TAG}:meta'
-- ARGV: cursor (SCAN's, '0' to start), count (keys one page scans)
-- Returns {next_cursor, entry...}, each entry {kind, suffix, pttl_ms, fields...}: kind 'hash'
-- (the meta hash, a definition, a counter: field, value, ...) or 'open' (the open-lease set:
-- reservation id, expires_at_ms, ...); suffix is the key after 'sc:{TAG}:'. Next cursor '0':
-- done.
-- Why: an export must find every period window a budget has counters in, and the scripts keep
-- no list of them; SCAN with the tag's prefix reads them where they are, on the node that holds
-- the tag's slot (this script runs there), a bounded page per call. Reservation records are read
-- separately (read.lua) from the open-lease set: only open ones are exported. Reads only.
local cursor, count = ARGV[1], int(ARGV[2], 'count')
local prefix = prefix_of(KEYS[1])
local page = redis.call('SCAN', cursor, 'MATCH', prefix .. '*', 'COUNT', istr(count))
local out = {page[1]}
for _, key in ipairs(page[2]) do
  local suffix = string.sub(key, #prefix + 1)
  local kind = nil
  if suffix == META_KEY or string.sub(suffix, 1, #DEFINITION_KEY) == DEFINITION_KEY
      or string.sub(suffix, 1, #COUNTER_KEY) == COUNTER_KEY then
    kind = 'hash'
  elseif suffix == OPEN_KEY then
    kind = 'open'
  end
  if kind then
    local entry = {kind, suffix, redis.call('PTTL', key)}
    local values
    if kind == 'hash' then
      values = redis.call('HGETALL', key)
    else
      values = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
    end
    for _, v in ipairs(values) do
      entry[#entry + 1] = v
    end
    out[#out + 1] = entry
  end
end
return out
