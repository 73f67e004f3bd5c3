-- Registers `body` (one of the functions above) as the function `name` of this library
-- (after its PREFIX, set in the first line: the library's name) with `flags`. A
-- library keeps its state between calls: each call first sets the call's keys and
-- arguments where the scripts read them (`inputs`, from the prelude) and forgets the clock
-- that the call before it read (clock.lua).
local function register(name, body, flags)
  redis.register_function{
    function_name = PREFIX .. name,
    callback = function(keys, args)
      KEYS, ARGV, CLAIMS = inputs(keys, args)
      clock_ms = nil
      return body()
    end,
    flags = flags,
  }
end
