-- KEYS: the keys to look at. No ARGV. Reads only: an operator's view of the locks.
-- Returns four numbers per key, in the order of KEYS: its state (0 free, 1 held
-- exclusively, 2 foreign, 3 held shared), the ms left on its holds (or on a foreign key's
-- ttl; -1 when free or without a ttl), how many holds it has, and how many waiters stand in
-- line for it: live reservations in its value, and live claims that name it (claims.lua).
-- Never the owner token or a hold id: those are capabilities.
local out = {}
-- How many live claims name each key.
local claims, names, in_claims = claims_before(nil), names_from(1), {}
for _, ticket in ipairs(claims) do
  for at in pairs(claimed({ticket}, names)) do in_claims[at] = (in_claims[at] or 0) + 1 end
end
each_value(1, function(i, value)
  local state, left, holds, waiters = 0, -1, 0, in_claims[i] or 0
  if value == false then
    -- MGET answers nil for a missing key and for a key of another type: only the latter is
    -- there, and foreign.
    if redis.call('EXISTS', KEYS[i]) == 1 then state = 2 end
  else
    local held, queue, hold_end = split(value)
    if held == nil then
      state = 2
    else
      if held ~= '' and is_shared(held) then
        -- Only the holds that have not ended; none: free. The key's ttl may outlast its
        -- holds, by a reader that released: the longest hold's end is the key's.
        local live, latest = live_readers(held)
        if live ~= '' then
          state, holds, left = 3, #live / READER_LEN, latest - now()
        end
      elseif held ~= '' then
        state = 1
        holds = (#held - 32) / 17
        -- Reservations outlive the holds: the value keeps their end.
        if hold_end then left = hold_end - now() end
      end
      for _, u in entries(queue) do
        if u > now() then waiters = waiters + 1 end
      end
    end
  end
  if (state == 1 and left < 0) or state == 2 then left = redis.call('PTTL', KEYS[i]) end
  out[#out + 1] = state
  out[#out + 1] = left
  out[#out + 1] = holds
  out[#out + 1] = waiters
end)
return out
