-- Badge counts of several users. KEYS: their hashes.
-- Returns {total mentions, unread channels} per user, in order.
local out = {}
for k = 1, #KEYS do
  local fields = redis.call('HGETALL', KEYS[k])
  local mentions, unread_channels = 0, 0
  local unread = {}
  for i = 1, #fields, 2 do
    local channel, part = string.match(fields[i], '^(%d+):(%a)$')
    local value = tonumber(fields[i + 1])
    if channel and value > 0 and (part == 'm' or part == 'u') then
      if part == 'm' then
        mentions = mentions + value
      end
      if not unread[channel] then
        unread[channel] = true
        unread_channels = unread_channels + 1
      end
    end
  end
  out[k] = {mentions, unread_channels}
end
return out
