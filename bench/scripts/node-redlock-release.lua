-- node-redlock 5's release of a batch, written for this bench from that library's
-- description: a key is deleted only while it holds the owner's value.
-- KEYS: the batch; ARGV: the owner's value.
-- Returns the number of keys released.
local released = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    released = released + 1
  end
end
return released
