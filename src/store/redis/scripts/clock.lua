-- Redis's clock, read once per script and only when needed, and the fencing counter,
-- which never counts below it.

-- Redis's clock in milliseconds.
local clock_ms
local function now()
  if not clock_ms then
    local t = redis.call('TIME')
    clock_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return clock_ms
end

-- 2025-01-01T00:00:00Z in milliseconds: the epoch of the crate's tickets and tokens.
local EPOCH_MS = 1735689600000

-- Counts a grant in the fencing counter `counter` and returns the token: one more than the
-- counter holds, and at least the clock's floor, (now - 2025) ms * 1024. A counter that
-- lost its data (a restart without persistence, a failover to a replica that missed
-- counts) so starts above every token already handed out while the clock moves forward
-- and fewer than 1024 grants a millisecond were counted on average (`FencingToken` says
-- exactly). A counter that holds no number counts as lost. The numbers stay exact in
-- Lua's doubles (below 2^53) for centuries.
local function count_grant(counter)
  local held = tonumber(redis.pcall('GET', counter)) or 0
  local token = math.max(held + 1, (now() - EPOCH_MS) * 1024)
  redis.call('SET', counter, string.format('%d', token))
  return token
end
