-- The prelude of every script on one Redis (and on each Redlock master): KEYS are the keys,
-- and one command may name any number of them.
local function inputs(keys, args) return keys, args end
local per_key = false

-- Acquire's KEYS[1] is the namespace's fencing counter: a grant is counted there, in the
-- script (`count_grant`, clock.lua).
local counts_grants = true

-- Waiters with big batches keep their place in line with claims (claims.lua): a script may
-- touch keys it was not given.
local keeps_claims = true

-- Tells waiters in other processes which wake-up slots were freed.
local function announce(channel, slots) redis.call('PUBLISH', channel, slots) end

