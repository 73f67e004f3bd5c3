-- node-redlock 5's acquire of a batch, written for this bench from that library's
-- description (one script per batch, every key checked before any is written).
-- KEYS: the batch; ARGV: the owner's value, the ttl (ms).
-- Returns the number of keys taken: all of them, or 0 when any key exists.
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then return 0 end
end
for _, key in ipairs(KEYS) do
  redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
end
return #KEYS
