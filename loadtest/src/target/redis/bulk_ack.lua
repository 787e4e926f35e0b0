-- Normal acks of several channels as one change. KEYS[1]: the user's hash.
-- ARGV: now_us, then (channel, message id) pairs. Returns the acks applied.
local applied = 0
for i = 2, #ARGV, 2 do
  local a = ARGV[i] .. ':a'
  local last = tonumber(redis.call('HGET', KEYS[1], a) or '0')
  if tonumber(ARGV[i + 1]) > last then
    redis.call('HSET', KEYS[1], a, ARGV[i + 1], ARGV[i] .. ':m', 0, ARGV[i] .. ':u', 0)
    applied = applied + 1
  end
end
if applied > 0 then
  local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
  redis.call('HSET', KEYS[1], 'v', math.max(v + 1, tonumber(ARGV[1])))
end
return applied
