-- dump_tag: one page of a tag's budgets and counters as they are kept, for an export.
--
-- KEYS[1] meta hash 'sc:{TAG}:meta'
-- ARGV: cursor (SCAN's, '0' to start), count (keys one page scans)
-- Returns {next_cursor, entry...}, each entry {'hash', suffix, pttl_ms, field, value, ...}: the
-- meta hash, a definition or a counter, suffix being the key after 'sc:{TAG}:'. Next cursor
-- '0': done.
-- Why: an export must find every period window a budget has counters in, and the scripts keep
-- no list of them; SCAN with the tag's prefix reads them where they are, on the node that holds
-- the tag's slot (this script runs there), a bounded page per call. Open reservations are read
-- apart (the open-lease set, then read.lua): core/stores/operations.py dump_tag says in which
-- order, and why. Reads only.
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
  end
end
return out
