-- KEYS: keys that kept a waiter's last attempt out. ARGV: owner token, the caller's ticket
-- (as acquire's), the modes (as acquire's, for these keys).
-- Returns how many keys, from the first, would not keep the caller out now: it stops at
-- the first that would, so that a waiter that probes what blocked it pays for what was
-- freed since, not for its batch. A key that an earlier waiter's claim names keeps the
-- caller out as acquire finds it does. Writes nothing.
--
-- The values are read as acquire reads a big batch's (`each_value`, a chunk at a time,
-- short ones first): a key of another type reads as none, and the attempt that follows
-- finds it foreign.
local owner, modes = ARGV[1], ARGV[3]
local ticket = ARGV[2] ~= '' and ARGV[2] or nil
local before = claims_before(ticket)
-- Which keys earlier claims name, looked up a chunk at a time (`chunk_after`), so that a
-- probe that stops at its first keys pays for those.
local claimed_by, looked = {}, 0
local function claimed_at(i)
  if #before == 0 then return nil end
  while i > looked do
    local to = math.min(#KEYS, looked + chunk_after(looked))
    for at, claim in pairs(claimed(before, names_from(looked + 1, to))) do
      claimed_by[looked + at] = claim
    end
    looked = to
  end
  return claimed_by[i]
end
local free = 0
each_value(1, function(i, value)
  -- A key with no value keeps out no one but the caller of an earlier claim: most keys of
  -- a woken purchase order. A probe of 1,000 free keys took 0.54-0.73 ms of Redis's time
  -- read a key a command, 0.35-0.37 read with MGET and each key passed to `keeps_out`,
  -- and takes 0.16-0.17 so (`INFO commandstats`).
  local holds = ''
  if value then
    local shared, queue
    if #modes == 1 then shared = modes == 's' else shared = string.byte(modes, i) == 115 end
    holds, queue = split(value)
    if keeps_out(holds, queue, owner, ticket, shared) then return true end
  end
  if claimed_at(i) and not owner_holds(holds, owner) then return true end
  free = free + 1
end, true)
return free
