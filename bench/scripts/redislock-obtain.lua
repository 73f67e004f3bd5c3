-- bsm/redislock's ObtainMulti, written for this bench from that library's description:
-- one MSETNX of every key to the token, then a PEXPIRE of each key.
-- KEYS: the batch; ARGV: the token, the ttl (ms).
-- Returns the number of keys taken: all of them, or 0 when any key exists.
--
-- The MSETNX names the whole batch in one call, as redislock's does, through `unpack` of
-- 2n values, which fails near 8,000 values: above about 4,000 keys this script fails, as
-- redislock's does, and the bench records that error. Calling MSETNX a thousand keys at a
-- time, as the crate's scripts slice their MGET and DEL, would need an undo of the slices
-- already set when a later one is refused: another algorithm than redislock's.
-- redislock's re-entry path (when MSETNX refuses, take the keys anyway if each starts with
-- the caller's token) is left out: an uncontended batch with a fresh token never takes it.
local pairs_to_set = {}
for i, key in ipairs(KEYS) do
  pairs_to_set[2 * i - 1] = key
  pairs_to_set[2 * i] = ARGV[1]
end
if redis.call('MSETNX', unpack(pairs_to_set)) == 0 then return 0 end
for _, key in ipairs(KEYS) do
  redis.call('PEXPIRE', key, ARGV[2])
end
return #KEYS
