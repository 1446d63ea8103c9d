-- alert_done: record one delivery attempt of an alert event.
--
-- KEYS[1] outbox 'sc:{TAG}:outbox'   KEYS[2] the event 'sc:{TAG}:ev:<event_id>'
-- ARGV: event_id, outcome ('delivered' | 'retry' | 'failed'), attempts (this attempt's number),
--       next_at_ms (for 'retry'), last_error (text, '' for none), [now_ms]
-- Returns {'ok'} or {'gone'} (the event expired).
-- Why: the deliverer decides the backoff (core/alerts.py); this keeps what it decided with the
-- event, which then leaves the outbox (delivered, failed) or waits for its next attempt. The
-- attempt's number is given, not counted here, so running this twice records one attempt.
local id, outcome, attempts, next_at = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
int(attempts, 'attempts')
local now = ledger_now(ARGV[6])
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('ZREM', KEYS[1], id)
  return {'gone'}
end
redis.call('HSET', KEYS[2], 'attempts', attempts, 'last_error', ARGV[5],
           'last_attempt_ms', istr(now))
if outcome == 'retry' then
  redis.call('HSET', KEYS[2], 'next_at_ms', istr(int(next_at, 'next_at_ms')))
  redis.call('ZADD', KEYS[1], next_at, id)
  return {'ok'}
end
if outcome ~= 'delivered' and outcome ~= 'failed' then
  fail('BADARG', 'outcome')
end
redis.call('HSET', KEYS[2], 'state', outcome, 'done_ms', istr(now))
redis.call('ZREM', KEYS[1], id)
-- kept for the alert log a retention after it was delivered or given up on
redis.call('PEXPIRE', KEYS[2], istr(ALERT_RETENTION_MS))
return {'ok'}
