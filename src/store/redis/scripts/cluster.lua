-- The prelude of every script on a Redis Cluster node, where one call carries the keys of a
-- batch that this node serves: keys of many hash slots.
--
-- Redis refuses (CROSSSLOT) a call whose declared keys hash to several slots, with the
-- `allow-cross-slot-keys` flag or without it; the flag (which every function of this
-- library has) only lets the script itself touch keys of several slots of this node, and
-- still each command one slot at a time. So the keys come as arguments (the call's first
-- argument: the node's claims registry; the second: how many keys; then the keys; then the
-- script's own arguments), and `inputs` hands them to the script as KEYS and ARGV, which
-- it reads as on one Redis, and the registry as CLAIMS. Every command names one key
-- (`per_key`), or keys of one slot: the registry and its claims share a hash tag.
--
-- The registry is a key of a slot that this node serves, chosen by the cluster store from
-- its slot map (`topology.rs`), the same in every process that has the same map: each
-- node keeps the claims of the groups it serves (claims.lua).
--
-- A command on a key that this node does not serve (its slot moved, or is migrating and
-- the key is not here) fails the script there; so does one on the registry, whose slot
-- moved: the store reads the map again and names the node's new registry. Acquire reads
-- the registry before it writes, and reads every key of a big group first (GET) or takes
-- every key of a small one with a protected SET NX, undoing what it took before failing,
-- so a group is all or nothing; extend reads every key before it writes; release,
-- withdraw and force_release may stop midway, and the cluster store runs them again on
-- the keys' new nodes (each is idempotent).
local function inputs(_, args)
  local count, keys, rest = tonumber(args[2]), {}, {}
  for i = 3, count + 2 do keys[#keys + 1] = args[i] end
  for i = count + 3, #args do rest[#rest + 1] = args[i] end
  return keys, rest, args[1]
end
local per_key = true

-- A node counts nothing: the cluster store takes the token from the namespace's one
-- counter (count_grant.lua) once every group of the batch was granted (see `store/cluster`).
local counts_grants = false

-- PUBLISH on a cluster reaches every node; the cluster store announces a release once,
-- with SPUBLISH, which reaches only the channel's shard.
local function announce() end

