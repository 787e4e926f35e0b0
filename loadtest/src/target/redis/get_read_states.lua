-- Every read state of a user, with the badge counts computed here as
-- readstates computes them. KEYS[1]: the user's hash.
-- Returns {version, total mentions, unread channels, field, value, ...}.
local fields = redis.call('HGETALL', KEYS[1])
local mentions, unread_channels = 0, 0
local unread = {}
for i = 1, #fields, 2 do
  local name, value = fields[i], tonumber(fields[i + 1])
  local channel, part = string.match(name, '^(%d+):(%a)$')
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
return {redis.call('HGET', KEYS[1], 'v') or '0', mentions, unread_channels, fields}
