-- KEYS: keys of a big exclusive batch (a step of it) of a waiter that keeps its place with
-- a claim (claims.lua). ARGV: owner token, the waiter's ticket, reservation ttl (ms), and
-- the position in KEYS (from 1) of the key that a probe just found keeping the waiter out,
-- to look at again ('0': none, a step before the last).
-- Puts every key in the waiter's claim, without reading them: what a refused attempt
-- would, where the attempt reads every key first (for 2,000 keys amid purchase orders,
-- 2.9 ms of Redis's time, against a probe of its first keys and this; see `steps.rs`).
-- Returns -2 when that key no longer keeps the waiter out (a release ran between the probe
-- and this call, and woke no one: the waiter tries its batch now); otherwise the ms until
-- the hold on it ends, or -1 when no hold's end is known (a claim, a foreign value). The
-- key is read before the claim is written (the script is one step either way), so that a
-- read that fails (on a cluster node, a slot that moved) leaves nothing behind.
local owner, ticket, reserve_ms, at = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
-- How long until KEYS[at] frees, as above.
local function ends_in()
  if at == 0 then return -1 end
  local value = redis.pcall('GET', KEYS[at])
  if type(value) == 'table' then
    -- A key of another type: foreign. Any other error (a key this node does not serve)
    -- fails the script.
    if string.sub(value.err or '', 1, 9) ~= 'WRONGTYPE' then error(value) end
    return -1
  end
  local holds, queue, hold_end = '', '', nil
  if value then
    holds, queue, hold_end = split(value)
    if keeps_out(holds, queue, owner, ticket, false) then
      if holds == '' then return -1 end
      local left = hold_left(KEYS[at], holds, hold_end)
      return left >= 0 and left or -1
    end
  end
  local before = claims_before(ticket)
  if #before > 0 and claimed(before, {KEYS[at]})[1] and not owner_holds(holds, owner) then
    return -1
  end
  return -2
end
local answer = ends_in()
if answer ~= -2 then claim(ticket, names_from(1), now() + reserve_ms) end
return answer
