-- The least a scripted release that checks the owner can do, for this bench: the values
-- read with one MGET and the keys that hold the owner's value deleted with one DEL, a
-- thousand keys at a time (Lua's `unpack` fails near 8,000 values). A release must check
-- the value, since only the request that took a lock may release it, and bulk commands
-- cost Redis less a key than a command for each key would.
-- KEYS: the batch; ARGV: the owner's value.
-- Returns the number of keys deleted.
local released = 0
for from = 1, #KEYS, 1000 do
  local to = math.min(from + 999, #KEYS)
  local values = redis.call('MGET', unpack(KEYS, from, to))
  local ours = {}
  for j = 1, #values do
    if values[j] == ARGV[1] then ours[#ours + 1] = KEYS[from + j - 1] end
  end
  if #ours > 0 then released = released + redis.call('DEL', unpack(ours)) end
end
return released
