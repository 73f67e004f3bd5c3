-- KEYS: keys of a batch. ARGV: the waiter's ticket, reservation ttl (ms).
-- Puts (or renews) the waiter's reservation on every key, held or free, as a refused
-- acquisition of a waiter in line does; foreign values are left alone. For a batch that
-- was refused after part of it was granted (by a cluster group, or an earlier step): the
-- granted part keeps the waiter's place in line as the refused part does, reserved before
-- it is rolled back (a release keeps a key's reservations), so that it is never free of
-- both in between; and the steps not tried yet are reserved too.
local ticket, reserve_ms = ARGV[1], tonumber(ARGV[2])
local till = now() + reserve_ms
each_value(1, function(i, value)
  if not value then
    -- NX: a key of another type also reads as no value, and stays as it is.
    redis.call('SET', KEYS[i], '|' .. ticket .. '/' .. string.format('%d', till), 'PX', reserve_ms, 'NX')
    return
  end
  local holds, queue, hold_end = split(value)
  if holds == nil then return end
  local left, latest = requeue(queue, ticket, till)
  write(KEYS[i], holds, left, latest, hold_end)
end)
return 1
