-- The prelude of every script on a Redis Cluster node, where one call carries the keys of a
-- batch that this node serves: keys of many hash slots.
--
-- Redis refuses (CROSSSLOT) a call whose declared keys hash to several slots, with the
-- `allow-cross-slot-keys` flag or without it; the flag (which every function of this
-- library has) only lets the script itself touch keys of several slots of this node, and
-- still each command one slot at a time. So the keys come as arguments (the call's first
-- argument: how many; then the keys; then the script's own arguments), and `inputs` hands
-- them to the script as KEYS and ARGV, which it reads as on one Redis. Every command names
-- one key (`per_key`).
--
-- A command on a key that this node does not serve (its slot moved, or is migrating and
-- the key is not here) fails the script there. Acquire touches every key first with a
-- protected SET NX and undoes what it took before failing, so a group is all or nothing;
-- extend reads every key before it writes; release, withdraw and force_release may stop
-- midway, and the cluster store runs them again on the keys' new nodes (each is
-- idempotent).
local function inputs(_, args)
  local count, keys, rest = tonumber(args[1]), {}, {}
  for i = 2, count + 1 do keys[#keys + 1] = args[i] end
  for i = count + 2, #args do rest[#rest + 1] = args[i] end
  return keys, rest
end
local per_key = true

-- A node counts nothing: the cluster store takes the token from the namespace's one
-- counter (count_grant.lua) once every group of the batch was granted (see `store/cluster`).
local counts_grants = false

-- Waiters keep their place in line with reservations in the keys, and never a claim
-- (claims.lua): a script may touch only the keys of the slots it was given.
local keeps_claims = false

-- PUBLISH on a cluster reaches every node; the cluster store announces a release once,
-- with SPUBLISH, which reaches only the channel's shard.
local function announce() end

