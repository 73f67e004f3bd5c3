-- The lock value, shared by the scripts that read or write one (prepended to each).
--
-- A lock key is a string: the holds, then the reservations of waiters, either part empty.
-- The holds are exclusive (one owner's) or shared (any number of owners'):
--
--   <owner>:<hold>[:<hold>...]                       |<ticket>/<until>[|<ticket>/<until>...]
--   *<owner>:<hold>/<until>[*<owner>:<hold>/<until>...]
--
-- <owner> is the 32 hex digits of the owner token and each <hold> the 16 hex digits of one
-- acquisition by that owner (re-entry adds holds; the key goes with its last one). An
-- exclusive value's holds end together, with the key's PX ttl; a hold its owner took
-- shared follows a ';' rather than a ':', so that the key turns shared again when its
-- last ':' hold ends. A shared hold ends on its own, at its <until> (Redis time, ms, 13
-- digits), so that a reader that died takes only its own hold with it; the key's ttl is
-- at least its longest hold's, and holds past their <until> keep nobody out, and go with
-- the next release of the key. A reservation is a waiter's ticket (smaller is earlier: 36
-- digits) and the Redis time in milliseconds until which it counts (13 digits), an entry
-- of 51 bytes, so that a script reads each field at its offset rather than by matching a
-- pattern character by character; they are kept in ticket order, and keep later arrivals
-- out whatever the modes. The key lives as long as the longest of its holds and
-- reservations (`write`; the key of a long line, at least as long: `requeue_in_place`).
-- Exclusive holds end together, with the key's PX ttl, unless reservations outlive them:
-- then their end goes first in the queue, as the marker `|0/<until>` (ticket 0 is no
-- waiter's), and the key lives until its latest reservation, so that a holder whose
-- process died takes its holds with it, and not the line of waiters behind it. Past the
-- marker, the holds have ended (`split`).
--
-- Anything else under a lock key (a value another version or program wrote, or a key of
-- another type) is foreign: it conflicts and is never changed. Shared holds start with
-- '*', neither a hex digit nor '|', so that the previous version's scripts take them for
-- foreign too, rather than for free.

-- Whether `holds` has the form of exclusive holds: 32 hex digits, then ':' or ';' and 16
-- hex digits once or more. Anything else (a value of another program that merely has a
-- ':' in the same place) is foreign, and never written to. One hold, the common case, is
-- one match (0.8 us where the general check took 1.3).
local ONE_HOLD = '^' .. ('%x'):rep(32) .. '[:;]' .. ('%x'):rep(16) .. '$'
local function ours_in_form(holds)
  if #holds == 49 then return string.find(holds, ONE_HOLD) ~= nil end
  if #holds < 49 or (#holds - 32) % 17 ~= 0 then return false end
  if string.find(string.sub(holds, 1, 32), '%X') then return false end
  return string.gsub(string.sub(holds, 33), '[:;]' .. string.rep('%x', 16), '') == ''
end

-- Whether the exclusive holds `holds` belong to `owner`, and where its hold `hold` (16 hex
-- digits) is in them, if there.
local function exclusive_hold(holds, owner, hold)
  if string.sub(holds, 1, 32) ~= owner then return false end
  return true, string.find(holds, hold, 34, true)
end

-- A shared hold is one entry of 64 bytes, so that a script finds each field by its offset
-- rather than by parsing: '*', the owner (32 hex digits), ':', the hold id (16), '/', and
-- its end as 13 digits of Redis time in milliseconds (until the year 2286).
local READER_LEN = 64

-- The entry of `owner`'s shared hold `hold`, until `till` (ms).
local function reader_entry(owner, hold, till)
  return '*' .. owner .. ':' .. hold .. '/' .. string.format('%013d', till)
end

-- Whether `holds` are shared ones.
local function is_shared(holds)
  return string.byte(holds, 1) == 42
end

-- One whole entry, from where the pattern is applied. Built with string methods: while a
-- library loads, Redis hides the `string` table (not strings' own methods).
local READER = '^%*' .. ('%x'):rep(32) .. ':' .. ('%x'):rep(16) .. '/' .. ('%d'):rep(13)

-- Whether `holds` has the form of shared holds: whole entries, the first of them in every
-- character. A value another program wrote does not begin with one of these entries by
-- chance; checking every entry would cost each acquisition 1.5 us a reader (measured with
-- 16), where the first costs one such check whatever the number of readers. An entry
-- whose end is not a number counts as ended.
local function readers_in_form(holds)
  return #holds % READER_LEN == 0 and string.find(holds, READER) ~= nil
end

-- The end (ms) of the shared hold whose entry starts at `at` (0 if it is not a number).
local function reader_until(holds, at)
  return tonumber(string.sub(holds, at + 51, at + READER_LEN - 1)) or 0
end

-- The entries of `holds` whose hold has not ended, and the latest end among them (0 if
-- none).
local function live_readers(holds)
  local live, latest = {}, 0
  for at = 1, #holds, READER_LEN do
    local till = reader_until(holds, at)
    if till > now() then
      live[#live + 1] = string.sub(holds, at, at + READER_LEN - 1)
      if till > latest then latest = till end
    end
  end
  return table.concat(live), latest
end

-- Whether the shared holds `holds` that have not ended include one of `owner`, and one of
-- another owner; and the ids of `owner`'s.
local function sharers(holds, owner)
  local mine, others = {}, false
  for at = 1, #holds, READER_LEN do
    if reader_until(holds, at) > now() then
      if string.sub(holds, at + 1, at + 32) == owner then
        mine[#mine + 1] = string.sub(holds, at + 34, at + 49)
      else
        others = true
      end
    end
  end
  return mine, others
end

-- The length of a reservation's entry: '|', the ticket (36 digits), '/', its end (13).
local ENTRY_LEN = 51

-- The Redis time (ms) until which the entry at `at` of a line counts. An end that is not a
-- number has passed.
local function entry_until(queue, at)
  return tonumber(string.sub(queue, at + 38, at + 50)) or 0
end

-- The entries of a line that `split` gave: the position of each, and the Redis time (ms)
-- until which it counts.
local function entries(queue)
  local at = 1 - ENTRY_LEN
  return function()
    at = at + ENTRY_LEN
    if at > #queue then return nil end
    return at, entry_until(queue, at)
  end
end

-- Whether `queue` has an entry's separators where one starts at `at`.
local function entry_at(queue, at)
  return string.byte(queue, at) == 124 and string.byte(queue, at + 37) == 47
end

-- The ticket of the entry at `at` of `queue`. Tickets are strings of digits, too long for
-- Lua's doubles, all 36 long (leading zeros included): they compare as strings.
local function ticket_at(queue, at)
  return string.sub(queue, at + 1, at + 36)
end

-- The holds and the reservations of a value, or nil when the value is foreign; and the end
-- of its exclusive holds where the value keeps it (nil: the key's ttl). Shared holds come
-- as they are stored, ended ones included: the scripts look at ends only where they
-- matter, and a release drops the ended ones. Exclusive holds past their end come as none,
-- and the marker of their end is never part of the reservations: `write` puts it back.
local function split(value)
  if type(value) ~= 'string' or value == '' then return nil end
  local bar = string.find(value, '|', 1, true)
  local holds = bar and string.sub(value, 1, bar - 1) or value
  local queue = bar and string.sub(value, bar) or ''
  if holds ~= '' then
    local in_form
    if is_shared(holds) then in_form = readers_in_form(holds) else in_form = ours_in_form(holds) end
    if not in_form then return nil end
  end
  local marker = string.match(queue, '^|0/(%d+)')
  local hold_end = marker and tonumber(marker)
  if marker then
    queue = string.sub(queue, #marker + 4)
    if holds ~= '' and not is_shared(holds) and hold_end <= now() then holds = '' end
  end
  -- The line is checked at its ends: whole entries, the first and the last with their
  -- separators in place. A hot key's line is as long as its waiters, and every call on
  -- the key reads the value: checking every entry cost each call about 1.5 us a waiter (a
  -- probe of a key with 256 waiters in line, 0.4 ms), for a check that the holds' form
  -- already makes (another program's value does not begin with an owner's holds by
  -- chance). An entry in between whose end is not a number counts as ended (`entries`).
  if #queue % ENTRY_LEN ~= 0 then return nil end
  if queue ~= '' and not (entry_at(queue, 1) and entry_at(queue, #queue - ENTRY_LEN + 1)) then
    return nil
  end
  return holds, queue, hold_end
end

-- How the entry of `ticket` in a line starts: the text a script finds it by.
local function entry_start(ticket)
  return '|' .. ticket .. '/'
end

-- The entry that puts `ticket` in line until `till` (ms).
local function entry(ticket, till)
  return entry_start(ticket) .. string.format('%d', till)
end

-- A line of at most this many entries is read whole whenever a call changes its key: its
-- ended entries go, and its latest end is found exactly. A longer one, a hot key's, is
-- changed only where it changes (`requeue_in_place`). Read whole, a line cost 0.27 us an
-- entry to read and 0.8 us an entry to rebuild in each of a grant's three calls on a hot
-- key (the release, the next waiter's grant, the next arrival's place in line): 96 us a
-- grant with 64 waiters, 436 us with 256, against 23 and 71 us in place. What is left
-- grows with the line as Redis's own copies of the value do (a GET and a SET of a line of
-- 256 entries: 17 us).
local WHOLE_LINE = 4

-- `requeue` for a long line: `ticket`'s entry found by its text and cut out, ended entries
-- dropped only from the head (one in the middle keeps nobody out, and goes when it reaches
-- the head: behind a head that waits long, ended entries wait with it), and `ticket`'s
-- entry put in its place by halving. The latest end it gives is a bound: `till`, or the
-- key's own end if later, which is never earlier than its latest reservation's (`write`
-- keeps it so), and which it also gives as the end of exclusive holds that keep no end of
-- their own, so that `write` reads the key's ttl once. A key whose waiters all died so
-- lives on until its last hold's end or its latest reservation's so far, rather than
-- theirs. (A key the previous version granted may end before its line, as that version
-- left it; changed in place, it keeps that end until its holder's release rewrites it.) A
-- key without a ttl, which only another program leaves, is read whole.
local function requeue_in_place(key, queue, ticket, till)
  local pttl = redis.call('PTTL', key)
  if pttl < 0 then return nil end
  local mine = ticket and string.find(queue, entry_start(ticket), 1, true)
  if mine then
    queue = string.sub(queue, 1, mine - 1) .. string.sub(queue, mine + ENTRY_LEN)
  end
  local from = 1
  while from <= #queue and entry_until(queue, from) <= now() do
    from = from + ENTRY_LEN
  end
  if from > 1 then queue = string.sub(queue, from) end
  if till then
    -- The entries before `lo` have earlier tickets, those from `hi` on later ones.
    local lo, hi = 0, #queue / ENTRY_LEN
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if ticket_at(queue, mid * ENTRY_LEN + 1) < ticket then lo = mid + 1 else hi = mid end
    end
    local at = lo * ENTRY_LEN
    queue = string.sub(queue, 1, at) .. entry(ticket, till) .. string.sub(queue, at + 1)
  end
  local key_end = now() + pttl
  if queue == '' then return '', 0, key_end end
  return queue, math.max(key_end, till or 0), key_end
end

-- `requeue` for a short line, read whole: the live reservations of `queue` other than the
-- one of `ticket`, with `ticket`'s put in line until `till` when given, and the latest end
-- among them (0 if none). A line that loses no entry and gains none comes back as it is:
-- most calls on a key in line change nothing of its line.
local function requeue_whole(queue, ticket, till)
  local mine = ticket and string.find(queue, entry_start(ticket), 1, true)
  local latest, same = 0, till == nil
  if same then
    for at, u in entries(queue) do
      if u <= now() or at == mine then same = false break end
      if u > latest then latest = u end
    end
    if same then return queue, latest end
  end
  local out, placed = {}, till == nil
  latest = 0
  for at, u in entries(queue) do
    if u > now() and at ~= mine then
      if not placed and ticket < ticket_at(queue, at) then
        out[#out + 1] = entry(ticket, till)
        placed = true
      end
      out[#out + 1] = string.sub(queue, at, at + ENTRY_LEN - 1)
      if u > latest then latest = u end
    end
  end
  if not placed then out[#out + 1] = entry(ticket, till) end
  if till and till > latest then latest = till end
  return table.concat(out), latest
end

-- The line `queue` of `key` less the reservation of `ticket` (a decimal string, or nil),
-- with `ticket`'s put in line until `till` (ms) when `till` is given; and the latest end
-- among its reservations (0 if none), or for a long line a bound on it, for `write`; and
-- for a long line, the key's end, which exclusive holds that keep no end of their own end
-- with (`requeue_in_place`).
local function requeue(key, queue, ticket, till)
  if #queue > WHOLE_LINE * ENTRY_LEN then
    local left, latest, key_end = requeue_in_place(key, queue, ticket, till)
    if left then return left, latest, key_end end
  end
  return requeue_whole(queue, ticket, till)
end

-- Whether `ticket`'s reservation in `queue` ends after `till` - `reserve_ms` / 2: renewed
-- until `till`, it would gain less than half its time. Such a reservation stays as it is:
-- a waiter retries at every release of a key it wants, and most of its batch need not be
-- rewritten each time.
local function fresh(queue, ticket, till, reserve_ms)
  local at = string.find(queue, entry_start(ticket), 1, true)
  return at ~= nil and entry_until(queue, at) > till - reserve_ms / 2
end

-- Writes `holds` and `queue` (reservations, the latest of which ends at `latest`: for a
-- long line, a bound no earlier, `requeue`) under `key`, living as long as the longest of
-- them: deleted when both are empty. Exclusive holds end at `hold_end` (Redis ms; nil:
-- where the key's ttl ends now), each shared one at its own end. Where reservations
-- outlive exclusive holds, the holds' end goes in the value as its marker (see the top of
-- this file).
local function write(key, holds, queue, latest, hold_end)
  if holds == '' then
    if queue == '' then
      redis.call('DEL', key)
    else
      redis.call('SET', key, queue, 'PX', math.max(latest - now(), 1))
    end
    return
  end
  local ends
  if is_shared(holds) then
    ends = select(2, live_readers(holds))
  else
    ends = hold_end or now() + math.max(redis.call('PTTL', key), 0)
    if latest > ends then
      local marked = holds .. '|0/' .. string.format('%d', ends) .. queue
      redis.call('SET', key, marked, 'PX', math.max(latest - now(), 1))
      return
    end
  end
  redis.call('SET', key, holds .. queue, 'PX', math.max(math.max(ends, latest) - now(), 1))
end

-- Whether a live reservation in `queue` is earlier than `ticket` (any, when it is nil). The
-- line is in ticket order: its first live entry is the earliest.
local function reserved_before(queue, ticket)
  for at, u in entries(queue) do
    if u > now() then return ticket == nil or ticket_at(queue, at) < ticket end
  end
  return false
end

-- Whether a key whose value split into `holds` and `queue` (`holds` nil: foreign) keeps
-- out `owner` asking for it shared (`shared`) or exclusively, with the ticket `ticket` (a
-- string of digits; nil: in no line, kept out by every reservation). A key keeps it out when another
-- owner holds it in a mode that excludes it, when it is foreign, or when a waiter with an
-- earlier ticket reserved it, unless the owner holds it: an owner is never kept out of
-- its own keys. Also gives, for a shared key asked for exclusively, the owner's live
-- shared hold ids, and whether the conflict is an upgrade that other readers keep out.
local function keeps_out(holds, queue, owner, ticket, shared)
  if holds == nil then return true end
  if holds == '' then return reserved_before(queue, ticket) end
  if not is_shared(holds) then return string.sub(holds, 1, 32) ~= owner end
  if shared then
    -- Beside other readers, unless a waiter keeps it out: only the owner's own entries
    -- need reading, to let it past the waiters when it holds the key already.
    local ours = '*' .. owner .. ':'
    local at = string.find(holds, ours, 1, true)
    while at and reader_until(holds, at) <= now() do
      at = string.find(holds, ours, at + READER_LEN, true)
    end
    return not at and reserved_before(queue, ticket)
  end
  local ids, others = sharers(holds, owner)
  if others then return true, ids, #ids > 0 end
  -- The owner's alone, or ended: as a free key, unless the owner holds it.
  return #ids == 0 and reserved_before(queue, ticket), ids, false
end

-- How long until the holds on `key`, whose value split into `holds` (nil: foreign) and
-- `hold_end`, end (ms; negative: no end known): a shared key's latest live reader's end
-- (its ttl may outlast its holds: a long reader released), an exclusive hold's end where
-- the value marks it, or else the key's ttl.
local function hold_left(key, holds, hold_end)
  if holds ~= nil and is_shared(holds) then return select(2, live_readers(holds)) - now() end
  if hold_end then return hold_end - now() end
  return redis.call('PTTL', key)
end

-- Whether `owner` holds the key whose value split into `holds` (nil: foreign), live: it
-- is never kept out of its own keys, by reservations or claims.
local function owner_holds(holds, owner)
  if holds == nil or holds == '' then return false end
  if not is_shared(holds) then return string.sub(holds, 1, 32) == owner end
  return #sharers(holds, owner) > 0
end

-- The ticket (a decimal string) of the first live reservation in `queue`, which is in
-- ticket order; nil if none.
local function first_in_line(queue)
  for at, u in entries(queue) do
    if u > now() then return ticket_at(queue, at) end
  end
  return nil
end

-- The release message that names the wake-up slots `slots` (as the caller gave them) and
-- the waiters first in line, `heads`: `<slots>,#<ticket>...`; see `pubsub.rs`.
local function wake_message(slots, heads)
  local parts = {slots}
  for head in pairs(heads) do parts[#parts + 1] = '#' .. head end
  return table.concat(parts, ',')
end

-- The reply of a script that frees keys: how many it changed, then the tickets in `heads`.
local function freed(count, heads)
  local reply = {count}
  for head in pairs(heads) do reply[#reply + 1] = head end
  return reply
end

-- How many more of a list a look that may stop at its first find takes after `done` of
-- it: 16, then three times as many as so far, so that a look that stops early pays for a
-- few, and one that goes through asks each once, in a few more commands (five for 2,000).
local function chunk_after(done)
  return math.max(16, 3 * done)
end

-- The values of KEYS[first..], a thousand at a time (`unpack` fails near 8,000 values), or
-- one at a time where one command may only name keys of one slot (`per_key`, set by the
-- prelude): calls `each(index, value)` for every key, until a call returns true. With
-- `may_stop`, the first reads are short (`chunk_after`), so that a look that stops at its
-- first keys reads few more.
local function each_value(first, each, may_stop)
  if per_key then
    for i = first, #KEYS do
      -- As MGET, a key of another type reads as nil (GET refuses it); any other error
      -- (a key this node does not serve) still fails the script.
      local value = redis.pcall('GET', KEYS[i])
      if type(value) == 'table' and value.err then
        if string.sub(value.err, 1, 9) ~= 'WRONGTYPE' then error(value) end
        value = false
      end
      if each(i, value) then return end
    end
    return
  end
  local from = first
  while from <= #KEYS do
    local size = may_stop and math.min(1000, chunk_after(from - first)) or 1000
    local to = math.min(from + size - 1, #KEYS)
    local values = redis.call('MGET', unpack(KEYS, from, to))
    for j = 1, #values do
      if each(from + j - 1, values[j]) then return end
    end
    from = to + 1
  end
end

-- Deletes the keys of the list `keys`: a thousand at a time, or one at a time (`per_key`).
local function delete(keys)
  if per_key then
    for _, key in ipairs(keys) do redis.call('DEL', key) end
    return
  end
  for from = 1, #keys, 1000 do
    redis.call('DEL', unpack(keys, from, math.min(from + 999, #keys)))
  end
end
