-- A normal ack. KEYS[1]: the user's hash. ARGV: now_us, channel, message id.
-- Returns 1 if applied, 0 if the message is not past the last ack.
local a = ARGV[2] .. ':a'
local last = tonumber(redis.call('HGET', KEYS[1], a) or '0')
if tonumber(ARGV[3]) <= last then
  return 0
end
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
redis.call('HSET', KEYS[1], a, ARGV[3], ARGV[2] .. ':m', 0, ARGV[2] .. ':u', 0,
  'v', math.max(v + 1, tonumber(ARGV[1])))
return 1
