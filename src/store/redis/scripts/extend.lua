-- KEYS: the batch. ARGV: owner token, hold id, ttl (ms).
-- Extends the hold on every key to at least the ttl if every key still has it, and returns
-- 1; otherwise changes nothing and returns 0: a lease that lost one key has lost the batch.
-- On a shared key only this hold is extended: the other readers' end on their own.
local owner, hold, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local exact = owner .. ':' .. hold
local reader = '*' .. exact .. '/'
local held, shared, marked = true, {}, {}
each_value(1, function(i, value)
  -- The common case, a key with this hold and nothing else, needs no parsing.
  if not held or value == exact then return end
  local holds, queue, hold_end = split(value)
  if holds ~= nil and holds ~= '' and is_shared(holds) then
    local at = string.find(holds, reader, 1, true)
    held = at ~= nil and reader_until(holds, at) > now()
    shared[i] = {holds, queue, at}
  else
    held = holds ~= nil and select(2, exclusive_hold(holds, owner, hold)) ~= nil
    -- Holds whose end the value keeps (reservations outlive them): it moves, not the ttl.
    if held and hold_end then marked[i] = {holds, queue, hold_end} end
  end
end)
if not held then return 0 end
for i, parts in pairs(shared) do
  local holds, at = parts[1], parts[3]
  if reader_until(holds, at) < now() + ttl then
    holds = string.sub(holds, 1, at - 1) .. reader_entry(ARGV[1], ARGV[2], now() + ttl)
      .. string.sub(holds, at + READER_LEN)
    local queue, latest = requeue(KEYS[i], parts[2])
    write(KEYS[i], holds, queue, latest)
  end
end
for i, parts in pairs(marked) do
  local queue, latest = requeue(KEYS[i], parts[2])
  write(KEYS[i], parts[1], queue, latest, math.max(parts[3], now() + ttl))
end
for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ttl, 'GT') end
return 1
