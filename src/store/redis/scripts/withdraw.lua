-- KEYS: the batch. ARGV: the waiter's ticket, channel, wake-up slots.
-- Takes the waiter's reservations off the keys (a key that nobody holds or reserves any
-- more goes), and wakes the waiters in other processes that they kept out. Returns how
-- many keys had one.
local mark = '|' .. ARGV[1] .. '/'
local withdrawn = 0
each_value(1, function(i, value)
  if type(value) ~= 'string' or not string.find(value, mark, 1, true) then return end
  local holds, queue = split(value)
  if holds == nil then return end
  withdrawn = withdrawn + 1
  local left, latest = requeue(queue, ARGV[1])
  store(KEYS[i], holds, left, latest)
end)
if withdrawn > 0 then announce(ARGV[2], ARGV[3]) end
return withdrawn
