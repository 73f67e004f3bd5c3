-- KEYS: the batch. ARGV: the waiter's ticket, channel, wake-up slots (the message).
-- Takes the waiter's reservations off the keys (a key that nobody holds or reserves any
-- more goes), and wakes the waiters in other processes that they kept out: the ones now
-- first in line on a key not held exclusively. Returns how many keys had one, then the
-- tickets of those waiters.
local mark = '|' .. ARGV[1] .. '/'
local withdrawn, heads = 0, {}
each_value(1, function(i, value)
  if type(value) ~= 'string' or not string.find(value, mark, 1, true) then return end
  local holds, queue, hold_end = split(value)
  if holds == nil then return end
  withdrawn = withdrawn + 1
  local left, latest = requeue(queue, ARGV[1])
  write(KEYS[i], holds, left, latest, hold_end)
  if holds == '' or is_shared(holds) then note_head(heads, left) end
end)
if withdrawn > 0 then announce(ARGV[2], wake_message(ARGV[3], heads)) end
return freed(withdrawn, heads)
