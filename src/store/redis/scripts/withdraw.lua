-- KEYS: the batch. ARGV: the waiter's ticket, channel, wake-up slots (the message).
-- Takes the waiter's reservations off the keys (a key that nobody holds or reserves any
-- more goes), and the keys out of its claim (claims.lua), and wakes the waiters in other
-- processes that they kept out: the ones now first in line on a key not held exclusively.
-- Returns how many keys had one, then the tickets of those waiters.
local mark = entry_start(ARGV[1])
local withdrawn, heads, names, lines = 0, {}, {}, {}
local claimed_here = unclaim_part(ARGV[1], names_from(1))
each_value(1, function(i, value)
  local reserved = type(value) == 'string' and string.find(value, mark, 1, true)
  if not reserved and not claimed_here[i] then return end
  local holds, queue, hold_end = '', '', nil
  if value then holds, queue, hold_end = split(value) end
  if holds == nil then
    -- Foreign: never changed, and its claim is gone all the same.
    if claimed_here[i] then withdrawn = withdrawn + 1 end
    return
  end
  withdrawn = withdrawn + 1
  if reserved then
    local latest, key_end
    queue, latest, key_end = requeue(KEYS[i], queue, ARGV[1])
    write(KEYS[i], holds, queue, latest, hold_end or key_end)
  end
  if holds == '' or is_shared(holds) then
    names[#names + 1] = KEYS[i]
    lines[#lines + 1] = queue
  end
end)
note_heads(heads, names, lines)
if withdrawn > 0 then announce(ARGV[2], wake_message(ARGV[3], heads)) end
return freed(withdrawn, heads)
