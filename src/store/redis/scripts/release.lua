-- KEYS: the batch. ARGV: owner token, hold id, channel, wake-up slots (the message).
-- Ends the hold on the keys that still have it (a key goes with its last hold, and stays
-- for the waiters that reserved it), so that a late release never frees a key that expired
-- and went to someone else, nor another hold of the same owner, nor another reader's; and
-- announces the release to waiters in other processes: the slots, and the tickets of the
-- waiters first in line on the keys it freed (by a reservation or a claim: claims.lua), the
-- only waiters it can let in. Returns how many keys had the hold, then those tickets.
local owner, hold = ARGV[1], ARGV[2]
local exact = owner .. ':' .. hold
local reader = '*' .. exact .. '/'
local released, gone, heads = 0, {}, {}
-- The keys freed (for everyone, or for readers), and their lines where they have one (by
-- position in `names`); a key with neither holds nor line left only where a claim may
-- name it.
local names, lines = {}, {}
local claims = claims_before(nil)
each_value(1, function(i, value)
  -- The common cases, a key with this hold and nothing else, need no parsing: it goes.
  if value == exact or (type(value) == 'string' and #value == READER_LEN
      and string.sub(value, 1, #reader) == reader) then
    released = released + 1
    gone[#gone + 1] = KEYS[i]
    if #claims > 0 then names[#names + 1] = KEYS[i] end
    return
  end
  local holds, queue, hold_end
  if type(value) == 'string' and string.sub(value, 1, #exact + 1) == exact .. '|'
      and string.sub(value, #exact + 2, #exact + 3) ~= '0/' then
    -- This hold alone, then a line, the hold's end the key's: the value is this crate's (it
    -- starts with the owner's token), and only the line needs reading.
    holds, queue = exact, string.sub(value, #exact + 1)
  else
    holds, queue, hold_end = split(value)
  end
  if holds == nil or holds == '' then return end
  if is_shared(holds) then
    local at = string.find(holds, reader, 1, true)
    if not at then return end
    -- The other readers' holds that have not ended: ended ones go here, so that the holds
    -- of readers that died do not pile up on a key that others keep busy.
    holds = live_readers(string.sub(holds, 1, at - 1) .. string.sub(holds, at + READER_LEN))
  else
    local _, at = exclusive_hold(holds, owner, hold)
    if not at then return end
    holds = string.sub(holds, 1, at - 2) .. string.sub(holds, at + 16)
    if #holds == 32 then
      holds = ''
    elseif not string.find(holds, ':', 33, true) then
      -- Its last exclusive hold ended: the owner's shared holds under it are shared ones
      -- again, each until the key's end, and other readers may come in.
      local till, readers = hold_end or now() + math.max(redis.call('PTTL', KEYS[i]), 0), {}
      for id in string.gmatch(holds, ';(%x+)') do
        readers[#readers + 1] = reader_entry(owner, id, till)
      end
      holds = table.concat(readers)
    end
  end
  released = released + 1
  if holds == '' or is_shared(holds) then
    names[#names + 1] = KEYS[i]
    lines[#names] = queue
  end
  if holds == '' and queue == '' then
    gone[#gone + 1] = KEYS[i]
  else
    local left, latest, key_end = requeue(KEYS[i], queue)
    write(KEYS[i], holds, left, latest, hold_end or key_end)
  end
end)
delete(gone)
note_heads(heads, names, lines, claims)
if released > 0 then announce(ARGV[3], wake_message(ARGV[4], heads)) end
return freed(released, heads)
