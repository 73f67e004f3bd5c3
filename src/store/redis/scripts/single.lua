-- The prelude of every script on one Redis (and on each Redlock master): KEYS are the keys,
-- and one command may name any number of them.
local per_key = false

-- Counts a grant in the namespace's fencing counter (acquire's KEYS[1]): the token.
local function count_grant() return redis.call('INCR', KEYS[1]) end

-- Tells waiters in other processes which wake-up slots were freed.
local function announce(channel, slots) redis.call('PUBLISH', channel, slots) end

