-- KEYS: a namespace's fencing counter. No ARGV.
-- Counts a grant there (see clock.lua) and returns the token: the cluster store's, taken
-- from the namespace's one counter once every group of a batch was granted.
return count_grant(KEYS[1])
