-- audit_booked: the audit entry of a booking of unseen spend, written once per total booked.
--
-- KEYS[1] the audit stream (core/stores/keys.py AUDIT_KEY)
-- KEYS[2] the booked total the stream has an entry for, for (tag, provider, day), a string
--   (keys.py unseen_audited)
-- ARGV: was (that total as the caller read it, '0' for none), total (the tag's booked total for
--   the day now), retention_ms (of KEYS[2]), audit_retention_ms (entries older go: the stream's
--   MINID, by the server's time, which its entry ids are), then the entry's fields, name and
--   value in turn (core/audit.py audit_fields)
-- Returns 1 if the entry was written, 0 if not: the audited total is no longer `was` (another run
--   wrote the entry) or `total` is not above it.
-- Why: the booking (lua/book_unseen.lua) is in its budget's slot and the audit stream in the
-- catalogue's, so they cannot be one step; a run that dies between the two leaves a booking with
-- no entry. Any later run that finds the tag's booked total above the audited one writes the
-- entry for the difference here, and the check makes it once however many runs find it.
local was, total = ARGV[1], ARGV[2]
if (redis.call('GET', KEYS[2]) or '0') ~= was or tonumber(total) <= tonumber(was) then
  return 0
end
local t = redis.call('TIME')
local oldest = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[4])
redis.call('XADD', KEYS[1], 'MINID', '~', string.format('%d', math.max(0, oldest)), '*',
           unpack(ARGV, 5))
redis.call('SET', KEYS[2], total, 'PX', ARGV[3])
return 1
