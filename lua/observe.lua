-- observe: count one call's output length in its model's histogram, shared by all instances.
--
-- KEYS[1] histogram hash 'sc:{out:<model digest>}' (fields: bucket upper bounds, and 'n')
-- ARGV: bucket (output tokens, an upper bound from core/output_stats.py), observations_max,
--       idle_ms (the histogram is dropped this long after its last observation)
-- Returns {'ok', observations}.
-- Why: the gateway reserves a model's p95 output length while a budget is far from its ceiling,
-- so it needs recent lengths from every instance. Once there are observations_max, every count
-- is halved, so old calls fade and the histogram stays small. A replay counts a call twice,
-- which moves a p95 by nothing that matters; no money depends on it (settle charges actuals).
local bucket = int(ARGV[1], 'bucket')
local max = int(ARGV[2], 'observations_max')
local idle_ms = int(ARGV[3], 'idle_ms')
if idle_ms < 1 then fail('BADARG', 'idle_ms') end
redis.call('HINCRBY', KEYS[1], istr(bucket), 1)
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
if n > max then
  local all = redis.call('HGETALL', KEYS[1])
  for j = 1, #all, 2 do
    local half = math.floor(tonumber(all[j + 1]) / 2)
    if half == 0 then
      redis.call('HDEL', KEYS[1], all[j])
    else
      redis.call('HSET', KEYS[1], all[j], istr(half))
    end
  end
  n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
end
-- Model names come from callers: a histogram for a name nobody calls any more must go.
redis.call('PEXPIRE', KEYS[1], istr(idle_ms))
return {'ok', n}
