-- KEYS: the fencing counter. ARGV: a floor.
-- Raises the counter to the floor if it is lower, never lowers it. Redlock uses it to bring
-- a node's counter up to the token a majority agreed on, so that the next grant anywhere
-- in that majority counts on from there. A counter that holds no number counts as 0, as
-- the acquire script takes it.
if (tonumber(redis.pcall('GET', KEYS[1])) or 0) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
