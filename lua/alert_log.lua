-- alert_log: the tag's alert events, newest first.
--
-- KEYS[1] alert log 'sc:{TAG}:alerts' (event ids by when they happened, ms)
-- ARGV: limit, [now_ms]
-- Returns {event fields as HGETALL gives them, ...}, each a flat array.
-- Why: one read of a tag's log for GET /v1/admin/alerts and the page. Ids older than the
-- retention, or whose event expired, leave the log here, so it never outgrows what it shows.
local limit = int(ARGV[1], 'limit')
local now = ledger_now(ARGV[2])
local prefix = string.sub(KEYS[1], 1, #KEYS[1] - #ALERT_LOG_KEY)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', istr(now - ALERT_RETENTION_MS))
local out = {}
for _, id in ipairs(redis.call('ZREVRANGE', KEYS[1], '0', istr(limit - 1))) do
  local event = redis.call('HGETALL', prefix .. ALERT_KEY .. id)
  if #event == 0 then
    redis.call('ZREM', KEYS[1], id)
  else
    out[#out + 1] = event
  end
end
return out
