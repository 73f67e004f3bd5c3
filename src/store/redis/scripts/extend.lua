-- KEYS: the batch. ARGV: owner token, hold id, ttl (ms).
-- Extends every key to at least the ttl if every key still has the hold, and returns 1;
-- otherwise changes nothing and returns 0: a lease that lost one key has lost the batch.
local ours, hold = ARGV[1] .. ':', ':' .. ARGV[2]
local exact = ARGV[1] .. hold
local held = true
each_value(1, function(_, value)
  -- The common case, a key with this hold and nothing else, needs no parsing.
  if not held or value == exact then return end
  local holds = split(value)
  held = holds ~= nil and string.sub(holds, 1, 33) == ours
    and string.find(holds, hold, 33, true) ~= nil
end)
if not held then return 0 end
for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[3], 'GT') end
return 1
