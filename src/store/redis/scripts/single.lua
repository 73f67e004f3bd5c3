-- The prelude of every script on one Redis (and on each Redlock master): KEYS are the keys,
-- and one command may name any number of them; the claims registry is the store's one.
local function inputs(keys, args) return keys, args, CLAIMS end
local per_key = false

-- Acquire's KEYS[1] is the namespace's fencing counter: a grant is counted there, in the
-- script (`count_grant`, clock.lua).
local counts_grants = true

-- Tells waiters in other processes which wake-up slots were freed.
local function announce(channel, slots) redis.call('PUBLISH', channel, slots) end

