-- Claims: the place in line of a waiter with a big batch, kept apart from its keys.
--
-- A small batch's waiter writes its reservation into the value of each of its keys (see
-- value.lua). A big batch doing so would rewrite each of its keys three times, to wait, to
-- be granted and to be released, at 5-8 us a key in a script where an uncontended take
-- and release cost 1-2 us: most of what a 2,000-key purchase order amid others cost
-- Redis. So a big batch's waiter (the store decides which, and says so to the scripts)
-- keeps its place as one record, a claim: the set `CLAIMS .. ':' .. <ticket>` of its
-- keys, living until its reservation ends, and its ticket in the registry `CLAIMS`, a
-- sorted set scored by that end (Redis ms). `CLAIMS` (set by the store, before this file,
-- or by each call on a cluster node: cluster.lua) is outside every namespace's keys.
--
-- A live claim with an earlier ticket keeps a caller out of the keys it names, as an
-- earlier reservation in a key's value does, unless the caller's owner holds the key; and
-- a call that frees a key wakes the earliest waiter of both kinds on it (`note_heads`).
-- The keys stay as they are while their waiter waits: a held key keeps its hold, a free
-- key stays free (or absent), and a key whose hold expires keeps its claims, which do not
-- live in it. A grant ends its waiter's claim; a withdrawal takes its keys out of it.
-- A cluster node keeps the claims of the groups it serves, in a registry of its own (a
-- waiter's groups each claim their keys on their node), and each claim's set has the
-- registry's hash tag: the commands here name one slot each.

-- The set of the keys `ticket`'s waiter claims.
local function claim_key(ticket)
  return CLAIMS .. ':' .. ticket
end

-- The tickets of the live claims earlier than `ticket` (every live one for nil; never
-- `ticket`'s own), in ticket order. Without claims, one read of an absent key.
local function claims_before(ticket)
  local flat = redis.call('ZRANGE', CLAIMS, 0, -1, 'WITHSCORES')
  local out = {}
  for j = 1, #flat, 2 do
    if (ticket == nil or flat[j] < ticket) and tonumber(flat[j + 1]) > now() then
      out[#out + 1] = flat[j]
    end
  end
  -- Tickets are strings of digits, all of one length: they compare as strings.
  table.sort(out)
  return out
end

-- For each of the key names `names` (a list) that one of `claims` (tickets in order) names,
-- the earliest that does: a table from position in `names` to ticket. One command a claim
-- for a thousand names, each claim asked only of the names no earlier one named: big
-- batches overlap, and most of a batch's keys that a later claim names, an earlier one
-- names too. The first claim is asked of `names` as they are, with no list copied.
local function claimed(claims, names)
  local by = {}
  -- Positions in `names` that no claim looked up so far names (nil: every one).
  local left
  for _, ticket in ipairs(claims) do
    local count = left and #left or #names
    if count == 0 then break end
    local key, still = claim_key(ticket), {}
    for from = 1, count, 1000 do
      local to = math.min(from + 999, count)
      local member
      if left then
        local chunk = {}
        for j = from, to do chunk[j - from + 1] = names[left[j]] end
        member = redis.call('SMISMEMBER', key, unpack(chunk))
      else
        member = redis.call('SMISMEMBER', key, unpack(names, from, to))
      end
      for j = 1, #member do
        local at = left and left[from + j - 1] or from + j - 1
        if member[j] == 1 then by[at] = ticket else still[#still + 1] = at end
      end
    end
    left = still
  end
  return by
end

-- The names of KEYS[first..last] (last: the end of KEYS when nil), as a list for
-- `claimed`.
local function names_from(first, last)
  local names = {}
  for i = first, last or #KEYS do names[#names + 1] = KEYS[i] end
  return names
end

-- Puts the key names `names` in `ticket`'s claim, which lives until `till` (Redis ms), as
-- does the registry, which drops the claims that ended.
local function claim(ticket, names, till)
  if #names == 0 then return end
  local key = claim_key(ticket)
  for from = 1, #names, 1000 do
    redis.call('SADD', key, unpack(names, from, math.min(from + 999, #names)))
  end
  redis.call('PEXPIREAT', key, till)
  redis.call('ZADD', CLAIMS, till, ticket)
  redis.call('ZREMRANGEBYSCORE', CLAIMS, '-inf', now())
  if redis.call('PTTL', CLAIMS) < till - now() then redis.call('PEXPIREAT', CLAIMS, till) end
end

-- Ends `ticket`'s claim: its waiter was granted.
local function unclaim(ticket)
  redis.call('DEL', claim_key(ticket))
  redis.call('ZREM', CLAIMS, ticket)
end

-- Takes the key names `names` out of `ticket`'s claim (its waiter withdraws), and the
-- claim from the registry once it names none. Returns the set of positions in `names`
-- that it named.
local function unclaim_part(ticket, names)
  local named = {}
  if #names == 0 then return named end
  local key = claim_key(ticket)
  for from = 1, #names, 1000 do
    local to = math.min(from + 999, #names)
    local member = redis.call('SMISMEMBER', key, unpack(names, from, to))
    for j = 1, #member do
      if member[j] == 1 then named[from + j - 1] = true end
    end
    redis.call('SREM', key, unpack(names, from, to))
  end
  if redis.call('EXISTS', key) == 0 then redis.call('ZREM', CLAIMS, ticket) end
  return named
end

-- Whether a live claim of `claims` (tickets in order) earlier than `ticket` names a key
-- that `ticket`'s claim names (none when `ticket` is a reservation's: it has no claim).
-- Such a waiter cannot have its keys yet, whatever is freed, and is left asleep, to be
-- woken when that claim's keys are freed or withdrawn. (With four 2,000-key orders in
-- line, each release woke the three waiters, and two of them probed only to find the
-- first in their way.) Big batches overlap: the first shared key is found at once.
local function behind_claim(ticket, claims)
  for _, earlier in ipairs(claims) do
    if earlier >= ticket then return false end
    if redis.call('SINTERCARD', 2, claim_key(earlier), claim_key(ticket), 'LIMIT', 1) > 0 then
      return true
    end
  end
  return false
end

-- Whether `ticket`'s claim names one of the key names `names` (a list), asked a chunk at a
-- time (`chunk_after`, a thousand names a command at most), so that a claim that shares
-- keys with a big batch pays for a few of them.
local function names_any(ticket, names)
  local key, asked = claim_key(ticket), 0
  while asked < #names do
    local to = math.min(#names, asked + math.min(1000, chunk_after(asked)))
    for _, member in ipairs(redis.call('SMISMEMBER', key, unpack(names, asked + 1, to))) do
      if member == 1 then return true end
    end
    asked = to
  end
  return false
end

-- Adds to `heads` (a set of tickets) the waiters that a call that freed the keys `names`
-- (a list) may have let in, whose lines are `queues[j]` ('' or nil for none): the waiter
-- first in line on each key, the earlier of the line's first live reservation and the
-- earliest of the live claims `claims` (read here when nil) that names the key, unless an
-- earlier claim keeps it out of another key (`behind_claim`). A key without a line needs
-- no lookup of its own: a claim that no earlier claim shares a key with is the earliest
-- on each of its keys, so the claims to wake there are those of them that name one of
-- those keys, found with the first such key. A 2,000-key release with three claims in
-- line looked each of its keys up in one claim after another (about 2,900 lookups).
local function note_heads(heads, names, queues, claims)
  if #names == 0 then return end
  claims = claims or claims_before(nil)
  local lined, lined_names, plain = {}, {}, {}
  for j = 1, #names do
    if queues[j] and queues[j] ~= '' then
      lined[#lined + 1] = queues[j]
      lined_names[#lined_names + 1] = names[j]
    elseif #claims > 0 then
      plain[#plain + 1] = names[j]
    end
  end
  local by = claimed(claims, lined_names)
  for k = 1, #lined do
    local head = first_in_line(lined[k])
    if by[k] and (head == nil or by[k] < head) then head = by[k] end
    if head then heads[head] = true end
  end
  for head in pairs(heads) do
    if behind_claim(head, claims) then heads[head] = nil end
  end
  if #plain == 0 then return end
  -- Whether a claim names a freed key first: claims with no key in common cost
  -- `behind_claim` a whole set's walk each pair, and only those that do can be woken.
  for _, ticket in ipairs(claims) do
    if heads[ticket] == nil and names_any(ticket, plain) and not behind_claim(ticket, claims) then
      heads[ticket] = true
    end
  end
end
