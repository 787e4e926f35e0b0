-- A new message. KEYS: the mentioned users' hashes, the other recipients',
-- then the author's. ARGV: now_us, channel, message id, number of mentioned.
-- Counts rise only past each recipient's last ack; the author is acked.
-- Returns the read states changed.
local channel, id, mentioned = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local now = tonumber(ARGV[1])
local changed = 0
local function bump(key)
  local v = tonumber(redis.call('HGET', key, 'v') or '0')
  redis.call('HSET', key, 'v', math.max(v + 1, now))
end
for i = 1, #KEYS - 1 do
  local key = KEYS[i]
  local last = tonumber(redis.call('HGET', key, channel .. ':a') or '0')
  if id > last then
    if last == 0 then
      redis.call('HSETNX', key, channel .. ':a', 0)
    end
    redis.call('HINCRBY', key, channel .. ':u', 1)
    if i <= mentioned then
      redis.call('HINCRBY', key, channel .. ':m', 1)
    end
    bump(key)
    changed = changed + 1
  end
end
local author = KEYS[#KEYS]
local last = tonumber(redis.call('HGET', author, channel .. ':a') or '0')
if id > last then
  redis.call('HSET', author, channel .. ':a', ARGV[3], channel .. ':m', 0, channel .. ':u', 0)
  bump(author)
  changed = changed + 1
end
return changed
