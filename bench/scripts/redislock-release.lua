-- bsm/redislock's release of a batch, written for this bench from that library's
-- description: one MGET of the batch; when every key holds the token, one DEL of them all.
-- KEYS: the batch; ARGV: the token.
-- Returns the number of keys released: all of them, or 0 when any key is not the token's.
--
-- Like redislock's, it `unpack`s the whole batch (n values), within Lua's limit wherever
-- the obtain script's 2n values are.
local values = redis.call('MGET', unpack(KEYS))
for i = 1, #KEYS do
  if values[i] ~= ARGV[1] then return 0 end
end
return redis.call('DEL', unpack(KEYS))
