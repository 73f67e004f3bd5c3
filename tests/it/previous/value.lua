-- The lock value, shared by the scripts that read or write one (prepended to each).
--
-- A lock key is a string: the holds, then the reservations of waiters, either part empty:
--
--   <owner>:<hold>[:<hold>...]  |<ticket>/<until>[|<ticket>/<until>...]
--
-- <owner> is the 32 hex digits of the owner token and each <hold> the 16 hex digits of one
-- acquisition by that owner (re-entry adds holds; the key goes with its last one). A
-- reservation is a waiter's ticket (smaller is earlier) and the Redis time in milliseconds
-- until which it counts; they are kept in ticket order. The key's PX ttl is its holds'
-- when held, and its latest reservation's otherwise.
--
-- Anything else under a lock key (a value another version or program wrote, or a key of
-- another type) is foreign: it conflicts and is never changed. A later kind of hold (a
-- shared one, say) will start with a character that is neither a hex digit nor '|', so
-- that these scripts take it for foreign too, rather than for free.

-- Whether `holds` has the form of holds: 32 hex digits, then ':' and 16 hex digits once
-- or more. Anything else (a value of another program that merely has a ':' in the same
-- place) is foreign, and never written to.
local function ours_in_form(holds)
  if #holds < 49 or (#holds - 32) % 17 ~= 0 then return false end
  if string.find(string.sub(holds, 1, 32), '%X') then return false end
  return string.gsub(string.sub(holds, 33), ':' .. string.rep('%x', 16), '') == ''
end

-- The holds and the reservations of a value, or nil when the value is foreign.
local function split(value)
  if type(value) ~= 'string' or value == '' then return nil end
  local bar = string.find(value, '|', 1, true)
  local holds = bar and string.sub(value, 1, bar - 1) or value
  local queue = bar and string.sub(value, bar) or ''
  if holds ~= '' and not ours_in_form(holds) then return nil end
  if queue ~= '' and string.gsub(queue, '|%d+/%d+', '') ~= '' then return nil end
  return holds, queue
end

-- The live reservations of `queue` other than the one of `ticket` (a decimal string, or
-- nil), with `ticket`'s put in line until `till` (ms) when `till` is given; and the latest
-- expiry among them (0 if none).
local function requeue(queue, ticket, till)
  local mine = ticket and tonumber(ticket)
  local out, latest, placed = {}, 0, till == nil
  for t, u in string.gmatch(queue, '|(%d+)/(%d+)') do
    local tn, un = tonumber(t), tonumber(u)
    if un > now() and tn ~= mine then
      if not placed and tn > mine then
        out[#out + 1] = '|' .. ticket .. '/' .. string.format('%d', till)
        placed = true
      end
      out[#out + 1] = '|' .. t .. '/' .. u
      if un > latest then latest = un end
    end
  end
  if not placed then
    out[#out + 1] = '|' .. ticket .. '/' .. string.format('%d', till)
  end
  if till and till > latest then latest = till end
  return table.concat(out), latest
end

-- Writes `holds` and `queue` back under `key`: deleted when both are empty; with the holds'
-- ttl kept when held; living until its latest reservation otherwise.
local function store(key, holds, queue, latest)
  if holds ~= '' then
    redis.call('SET', key, holds .. queue, 'KEEPTTL')
  elseif queue == '' then
    redis.call('DEL', key)
  else
    redis.call('SET', key, queue, 'PX', math.max(latest - now(), 1))
  end
end

-- Whether a live reservation in `queue` is earlier than `ticket` (any, when it is nil).
local function reserved_before(queue, ticket)
  for t, u in string.gmatch(queue, '|(%d+)/(%d+)') do
    if tonumber(u) > now() and (ticket == nil or tonumber(t) < ticket) then return true end
  end
  return false
end

-- The values of KEYS[first..], a thousand at a time (`unpack` fails near 8,000 values), or
-- one at a time where one command may only name keys of one slot (`per_key`, set by the
-- prelude): calls `each(index, value)` for every key.
local function each_value(first, each)
  if per_key then
    for i = first, #KEYS do
      -- As MGET, a key of another type reads as nil (GET refuses it); any other error
      -- (a key this node does not serve) still fails the script.
      local value = redis.pcall('GET', KEYS[i])
      if type(value) == 'table' and value.err then
        if string.sub(value.err, 1, 9) ~= 'WRONGTYPE' then error(value) end
        value = false
      end
      each(i, value)
    end
    return
  end
  for from = first, #KEYS, 1000 do
    local to = math.min(from + 999, #KEYS)
    local values = redis.call('MGET', unpack(KEYS, from, to))
    for j = 1, #values do each(from + j - 1, values[j]) end
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
