-- alert_claim: take the tag's alert events that are due for delivery, for a while.
--
-- KEYS[1] outbox 'sc:{TAG}:outbox' (event ids by next attempt, ms)
-- ARGV: batch_max, lease_ms (how long the taker has before another may take them), [now_ms]
-- Returns {event fields as HGETALL gives them, ...} per event, each a flat array.
-- Why: delivery runs in every long-running instance and from schedulers; taking an event moves
-- its next attempt past the lease in the same step, so two deliverers never post one event at
-- the same time (a receiver still deduplicates on event_id: a deliverer that dies after the
-- post and before alert_done leaves it to be posted again after the lease).
local batch_max = int(ARGV[1], 'batch_max')
local lease_ms = int(ARGV[2], 'lease_ms')
local now = ledger_now(ARGV[3])
local prefix = string.sub(KEYS[1], 1, #KEYS[1] - #OUTBOX_KEY)
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', istr(now), 'LIMIT', '0',
                                istr(batch_max))) do
  local event = redis.call('HGETALL', prefix .. ALERT_KEY .. id)
  if #event == 0 then
    redis.call('ZREM', KEYS[1], id)  -- expired unsent: nothing left to post
  else
    redis.call('ZADD', KEYS[1], istr(now + lease_ms), id)
    out[#out + 1] = event
  end
end
return out
