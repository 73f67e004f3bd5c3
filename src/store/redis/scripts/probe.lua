-- KEYS: keys that kept a waiter's last attempt out. ARGV: owner token, the caller's ticket
-- (as acquire's), the modes (as acquire's, for these keys).
-- Returns how many keys, from the first, would not keep the caller out now: it stops at
-- the first that would, so that a waiter that probes what blocked it pays for what was
-- freed since, not for its batch. A key that an earlier waiter's claim names keeps the
-- caller out as acquire finds it does. Writes nothing.
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
for i = 1, #KEYS do
  local shared
  if #modes == 1 then shared = modes == 's' else shared = string.byte(modes, i) == 115 end
  -- A key of another type is foreign, and keeps everyone out (as in acquire); any other
  -- error (a key this node does not serve) fails the script.
  local value = redis.pcall('GET', KEYS[i])
  if type(value) == 'table' then
    if string.sub(value.err or '', 1, 9) ~= 'WRONGTYPE' then error(value) end
    value = 'foreign'
  end
  local holds, queue
  if value then holds, queue = split(value) else holds, queue = '', '' end
  if keeps_out(holds, queue, owner, ticket, shared) then return free end
  if claimed_at(i) and not owner_holds(holds, owner) then return free end
  free = free + 1
end
return free
