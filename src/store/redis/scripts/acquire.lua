-- KEYS[1]: the namespace's fencing counter (on a cluster, a placeholder: see cluster.lua);
-- KEYS[2..]: the batch.
-- ARGV: owner token, hold id, ttl (ms), how many conflicts to name, the caller's ticket
-- (36 digits, see `ticket_at`; '' when it is in no line, and kept out by every
-- reservation; an owner that already holds keys gives its arrival's, and its own keys keep
-- it out of nothing), reservation ttl (ms; 0: reserve nothing), the
-- modes ('x' exclusive or 's' shared: one letter for the whole batch, or one per key),
-- '1' to count the grant ('0' for a step of a batch before its last: see `steps.rs`), the
-- release channel (where a shared grant wakes the waiter next in line, who may be a
-- reader too), '1' to read the values before writing (a big batch, or a waiter's retry,
-- whose reservations are on every key: see below), and '1' when the caller is a waiter
-- that keeps its place with a claim (a big batch: claims.lua) rather than with
-- reservations in the keys.
-- Returns the fencing token when granted (0 when the grant is not counted), a number: a
-- reply Redis converts at little cost, where a table of five values cost a tenth of a
-- one-key acquire and release. Otherwise {number of conflicting keys, earliest pttl among
-- the held ones or -1, {named keys}, 1 if a conflict is an upgrade the owner's fellow
-- readers keep out, else 0}.
--
-- A key keeps the caller out when another owner holds it in a mode that excludes the
-- caller's, when it is foreign, or when a waiter with an earlier ticket reserved it (any
-- waiter, for a caller in no line), unless the caller's owner holds it: an owner is never
-- kept out of its own keys, which it enters again in any mode, and takes exclusively from
-- shared when it is their only holder (an upgrade). A caller kept out that reserves (a
-- waiter in line) puts its reservation on every key of the batch, or the batch in its claim.
-- A key that an earlier waiter's claim names keeps the caller out as that waiter's
-- reservation would.
--
-- Each key of a small batch costs one command when it is free: SET NX takes it, GET shows
-- what was there instead; a big batch reads its values first (see below). Nothing a script
-- writes is seen by anyone before it ends, so a conflict found later simply undoes the keys
-- taken so far: no one ever sees part of a batch. No
-- `unpack` of the whole batch: it fails near 8,000 values.
local owner, hold, ttl, report = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local ticket = ARGV[5] ~= '' and ARGV[5] or nil
local reserve_ms = tonumber(ARGV[6])
local modes = ARGV[7]
local mine = owner .. ':' .. hold
local claiming = ARGV[11] == '1'

-- Whether KEYS[i] is wanted shared.
local function shared_at(i)
  if #modes == 1 then return modes == 's' end
  return string.byte(modes, i - 1) == 115
end

-- This hold as a shared one, until the ttl from now.
local function reader()
  return reader_entry(owner, hold, now() + ttl)
end

local conflicts, earliest, named, upgrade = 0, -1, {}, 0
-- The keys that earlier waiters' claims name: position in KEYS, less one, -> ticket.
local names = {}
local before = claims_before(ticket)
if #before > 0 or claiming then names = names_from(2) end
local claimed_by = claimed(before, names)

-- Counts KEYS[i] among the conflicts, named if there is room.
local function conflict(i)
  conflicts = conflicts + 1
  if #named < report then named[#named + 1] = KEYS[i] end
end
-- Keys this script created, keys that were there and keep nobody out (index -> parts), and
-- keys wanted exclusively that nobody holds and whose line the caller heads (index ->
-- value).
local taken, found, first = {}, {}, {}
-- How a value starts whose line the caller heads.
local heads_line = ticket and entry_start(ticket)
-- Looks at KEYS[i], whose value was `old` (false: none, and this script took it; a table:
-- a key of another type), as the batch's grant or refusal needs it.
local function look(i, old)
  local shared = shared_at(i)
  if not old then
    taken[#taken + 1] = i
    if claimed_by[i - 1] then conflict(i) end
  elseif heads_line and not shared and type(old) == 'string'
      and string.sub(old, 1, 38) == heads_line and #old % ENTRY_LEN == 0 then
    -- The common key of a waiter's retry: it keeps the waiter out of nothing (but an
    -- earlier claim), and a grant needs no more of it than the line behind the waiter's
    -- entry.
    first[i] = old
    if claimed_by[i - 1] then conflict(i) end
  else
    local holds, queue, hold_end = split(old)
    -- The owner's live shared hold ids, when a shared key is asked for exclusively.
    local blocked, ids, upgrading = keeps_out(holds, queue, owner, ticket, shared)
    if upgrading then upgrade = 1 end
    if not blocked and claimed_by[i - 1] then blocked = not owner_holds(holds, owner) end
    if blocked then
      conflict(i)
      if holds ~= '' then
        local left = hold_left(KEYS[i], holds, hold_end)
        -- Exclusive holds end with the key: where the reservation is written below, that
        -- end needs no second read.
        if not hold_end and holds ~= nil and not is_shared(holds) and left >= 0 then
          hold_end = now() + left
        end
        if left >= 0 and (earliest < 0 or left < earliest) then earliest = left end
      end
    end
    if holds ~= nil then found[i] = {holds, queue, ids, hold_end} end
  end
end

-- Takes KEYS[i] if it is free, as `SET NX GET` would: its old value (false when taken), or
-- a table for a key of another type or a write that Redis refused.
local function take(i, get)
  local value = shared_at(i) and reader() or mine
  if get then return redis.pcall('SET', KEYS[i], value, 'PX', ttl, 'NX', 'GET') end
  local set = redis.pcall('SET', KEYS[i], value, 'PX', ttl, 'NX')
  if type(set) == 'table' and set.err then return set end
  -- Not set: kept by a key of another type, foreign as `SET NX GET` finds it.
  return not set and {err = 'WRONGTYPE'}
end

-- Looks at KEYS[i] as `look` does, unless Redis refused the write itself (out of memory, a
-- read-only replica, ...): the store cannot lock, which is not contention. Then it undoes
-- the keys taken so far, and returns the error for the script to fail with.
local function look_unless_refused(i, old)
  if type(old) == 'table' and string.sub(old.err or '', 1, 9) ~= 'WRONGTYPE' then
    for _, j in ipairs(taken) do redis.call('DEL', KEYS[j]) end
    return redis.error_reply(old.err)
  end
  look(i, old)
end

-- A big batch, or a waiter's retry, which finds its own reservation on every key, reads
-- the values a thousand at a time (`each_value`) first, where `SET NX GET` would cost a
-- call a key: it takes with `SET NX` only keys that read as none (a reservation that ended,
-- or a key of another type, which that `SET` leaves alone), and those only once no other
-- key keeps it out. A refused big batch so writes no key: amid purchase orders, most first
-- attempts are refused, and taking their free keys to give them back cost Redis three
-- times as much as reading them. On a cluster node too, which reads a key a command (a
-- GET, as many commands as `SET NX GET` takes for a grant): at 16 retail + 4 purchase
-- clients its Redis CPU a grant went from 4.2 to 3.3-3.4 ms.
local reads, read, absent = ARGV[10] == '1', {}, {}
if reads then each_value(2, function(i, value) read[i] = value end) end
for i = 2, #KEYS do
  if not reads or read[i] then
    local failed = look_unless_refused(i, read[i] or take(i, true))
    if failed then return failed end
  else
    -- Free, but an earlier waiter's claim may name it (then it keeps the caller out, and
    -- is never taken: a key is taken below only once no key kept the caller out).
    if claimed_by[i - 1] then conflict(i) end
    absent[#absent + 1] = i
  end
end
local took_absent = conflicts == 0
if took_absent then
  for _, i in ipairs(absent) do
    local failed = look_unless_refused(i, take(i, false))
    if failed then return failed end
  end
end

if conflicts > 0 then
  for i, value in pairs(first) do found[i] = {'', value} end
  if claiming then
    -- A big batch's waiter keeps its place in its claim, and its keys as they were.
    local keys = {}
    for _, j in ipairs(taken) do keys[#keys + 1] = KEYS[j] end
    delete(keys)
    claim(ticket, names, now() + reserve_ms)
  elseif reserve_ms > 0 then
    -- A waiter in line reserves every key of its batch against later arrivals.
    local till = now() + reserve_ms
    local mark = entry(ticket, till)
    for _, i in ipairs(taken) do
      redis.call('SET', KEYS[i], mark, 'PX', reserve_ms)
    end
    if not took_absent then
      -- Those an earlier claim names too. A key of another type also read as none: NX
      -- leaves it as it is, and it is foreign (counted once).
      for _, i in ipairs(absent) do
        local set = redis.call('SET', KEYS[i], mark, 'PX', reserve_ms, 'NX')
        if not set and not claimed_by[i - 1] then conflict(i) end
      end
    end
    for i, parts in pairs(found) do
      if not fresh(parts[2], ticket, till, reserve_ms) then
        local queue, latest, key_end = requeue(KEYS[i], parts[2], ticket, till)
        write(KEYS[i], parts[1], queue, latest, parts[4] or key_end)
      end
    end
  else
    local keys = {}
    for _, j in ipairs(taken) do keys[#keys + 1] = KEYS[j] end
    delete(keys)
  end
  return {conflicts, earliest, named, upgrade}
end

-- The keys granted shared, and their lines: the waiter first in line on one, a reader
-- perhaps, may come in beside this one, and nothing else would wake it.
local shared_names, shared_lines = {}, {}
for i, value in pairs(first) do
  -- Its line, less the caller's entry.
  local queue, latest = requeue(KEYS[i], string.sub(value, ENTRY_LEN + 1))
  write(KEYS[i], mine, queue, latest, now() + ttl)
end
for i, parts in pairs(found) do
  local holds, queue, ids, hold_end = parts[1], parts[2], parts[3], parts[4]
  local latest, key_end = 0, nil
  if queue ~= '' then queue, latest, key_end = requeue(KEYS[i], queue, ticket) end
  if shared_at(i) then
    shared_names[#shared_names + 1] = KEYS[i]
    shared_lines[#shared_lines + 1] = queue
  end
  -- A shared key taken exclusively: the owner's shared holds that have not ended go with
  -- it; with none, it is taken as a free key.
  if ids and #ids == 0 then holds = '' end
  if holds == '' then
    write(KEYS[i], shared_at(i) and reader() or mine, queue, latest, now() + ttl)
  else
    -- A hold that is already there is this very acquisition, run again after a broken
    -- connection: once is enough.
    if not is_shared(holds) then
      -- The owner's own: enter it again, a shared hold after ';'.
      if not string.find(holds, hold, 34, true) then
        holds = holds .. (shared_at(i) and ';' or ':') .. hold
      end
    elseif shared_at(i) then
      if not string.find(holds, ':' .. hold .. '/', 1, true) then holds = holds .. reader() end
    else
      -- An upgrade: the owner's shared holds, alone on the key, are carried under this
      -- exclusive one, marked shared, until it ends.
      holds = owner .. ':' .. hold
      for _, id in ipairs(ids) do
        if id ~= hold then holds = holds .. ';' .. id end
      end
    end
    -- Never shortened: exclusive holds end with the later of theirs and this one's (an
    -- upgrade's, with the readers' it carries, whose end the key's ttl was).
    local ends = hold_end or key_end or now() + math.max(redis.call('PTTL', KEYS[i]), 0)
    write(KEYS[i], holds, queue, latest, math.max(ends, now() + ttl))
  end
end
if claiming and ARGV[8] == '1' then unclaim(ticket) end
-- A free key granted shared lets in a reader that a claim keeps in line.
for _, i in ipairs(taken) do
  if shared_at(i) then
    shared_names[#shared_names + 1] = KEYS[i]
    shared_lines[#shared_lines + 1] = ''
  end
end
local readers_next = {}
note_heads(readers_next, shared_names, shared_lines)
if next(readers_next) then announce(ARGV[9], wake_message('', readers_next)) end
return counts_grants and ARGV[8] == '1' and count_grant(KEYS[1]) or 0
