-- The least a scripted batch can do on Redis, for this bench: one SET NX PX a key, and
-- nothing else (no re-entry, no reservations, no fencing). Any batch lock in one Lua
-- script that keeps each key as a string with its own TTL does at least this: Redis 7 has
-- no command that sets the TTLs of many keys at once.
-- KEYS: the batch; ARGV: the owner's value, the ttl (ms).
-- Returns the number of keys taken: all of them, or 0 at the first key that exists (the
-- keys taken before it stay: an uncontended batch never finds one).
for _, key in ipairs(KEYS) do
  if not redis.call('SET', key, ARGV[1], 'PX', ARGV[2], 'NX') then return 0 end
end
return #KEYS
