-- KEYS: the keys. ARGV: channel, wake-up slots.
-- Ends every hold on the keys, whoever has it: an operator's tool for a stuck lock. The
-- waiters' reservations stay (a key that has some lives on until the latest of them, or
-- with a long line until its end before, if later: `requeue_in_place`), so
-- that the waiters in line still go first, in their order. Foreign values are left alone:
-- this crate cannot tell what they are. Announces the release to waiters in other
-- processes, with the waiters now first in line (by a reservation or a claim). Returns
-- how many keys were held, then the tickets of those waiters.
local released, heads, names, lines = 0, {}, {}, {}
each_value(1, function(i, value)
  if value == false then return end
  local holds, queue = split(value)
  if holds == nil or holds == '' then return end
  -- Shared holds that have all ended hold nothing.
  if is_shared(holds) and live_readers(holds) == '' then return end
  released = released + 1
  local left = ''
  if queue == '' then
    redis.call('DEL', KEYS[i])
  else
    local latest
    left, latest = requeue(KEYS[i], queue)
    write(KEYS[i], '', left, latest)
  end
  names[#names + 1] = KEYS[i]
  lines[#lines + 1] = left
end)
note_heads(heads, names, lines)
if released > 0 then announce(ARGV[1], wake_message(ARGV[2], heads)) end
return freed(released, heads)
