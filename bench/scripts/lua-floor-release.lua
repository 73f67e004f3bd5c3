-- The least a scripted release can do, for this bench: one DEL a key, whoever holds it.
-- KEYS: the batch; ARGV: the owner's value (unused: there is no check).
-- Returns the number of keys deleted.
local released = 0
for _, key in ipairs(KEYS) do
  released = released + redis.call('DEL', key)
end
return released
