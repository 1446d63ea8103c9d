-- lease_end: give back a lease this holder took (a string key SET NX PX with its token).
--
-- KEYS[1] the lease   ARGV[1] the holder's token
-- Returns 1 if it was this holder's and is gone, 0 otherwise.
-- Why: a holder whose lease ran out may find another's in its place; only its own is deleted,
-- in one step with the check.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
