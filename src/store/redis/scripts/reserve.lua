-- KEYS: keys of a batch. ARGV: the waiter's ticket, reservation ttl (ms), '1' when the
-- waiter keeps its place with a claim (claims.lua) rather than reservations in the keys.
-- Puts (or renews) the waiter's reservation on every key, held or free, as a refused
-- acquisition of a waiter in line does (or the keys in its claim); foreign values are left
-- alone. For a batch that was refused after part of it was granted (by a cluster group, or
-- an earlier step): the granted part keeps the waiter's place in line as the refused part
-- does, reserved before it is rolled back (a release keeps a key's reservations and
-- claims), so that it is never free of both in between; and the steps not tried yet are
-- reserved too. A reservation with more than half its time left stays as it is, as in
-- acquire.
-- Returns the positions in KEYS of the keys that keep the waiter out whatever its modes
-- (held exclusively, foreign, or reserved or claimed by an earlier waiter; a waiter in line
-- holds no keys of its own): the steps after a refused one, which the waiter probes before
-- it tries its batch again. Shared holds, which keep out only some, go unnamed.
local ticket, reserve_ms, claiming = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local till = now() + reserve_ms
local names = names_from(1)
local claimed_by = claimed(claims_before(ticket), names)
if claiming then claim(ticket, names, till) end
local blockers = {}
each_value(1, function(i, value)
  if not value then
    if claimed_by[i] then blockers[#blockers + 1] = i end
    -- NX: a key of another type also reads as no value, and stays as it is.
    if not claiming then
      redis.call('SET', KEYS[i], entry(ticket, till), 'PX', reserve_ms, 'NX')
    end
    return
  end
  local holds, queue, hold_end = split(value)
  if holds == nil then
    blockers[#blockers + 1] = i
    return
  end
  if (holds ~= '' and not is_shared(holds)) or reserved_before(queue, ticket) or claimed_by[i] then
    blockers[#blockers + 1] = i
  end
  if claiming or fresh(queue, ticket, till, reserve_ms) then return end
  local left, latest, key_end = requeue(KEYS[i], queue, ticket, till)
  write(KEYS[i], holds, left, latest, hold_end or key_end)
end)
return blockers
