-- cas: write several keys only if none changed since the decision was made
-- on them, and (deciding on Redis's clock) only if the decision's time is
-- Redis's. Each key is a hash: v = the value (bytes decided by the
-- service), t = its tag byte (absent on values stored before values carried
-- one), n = its version (chosen by the writer; absent = the key is absent).
-- KEYS[i]        the keys the decision was made on (one domain's hash tag)
-- ARGV[1]        the decision's time, µs since the epoch ('' = no check)
-- ARGV[2]        how far it may be from TIME, µs
-- ARGV[5i - 2]   the version the decision saw ('' = absent)
-- ARGV[5i - 1]   the new version; ARGV[5i] the new value ('' = leave the
--                key as it is, only check it); ARGV[5i + 1] its time to
--                live in ms; ARGV[5i + 2] its tag
-- Returns {1, seconds, µs} (TIME) when written; when a key changed or the
-- time was off, nothing is written and it returns {0, seconds, µs, v1, n1,
-- t1, v2, n2, t2, ...}: what the keys hold, to decide again on.
local time = redis.call('TIME')
local fresh = true
if ARGV[1] ~= '' then
  local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
  if math.abs(now - tonumber(ARGV[1])) > tonumber(ARGV[2]) then fresh = false end
end
if fresh then
  for i = 1, #KEYS do
    local seen = redis.call('HGET', KEYS[i], 'n') or ''
    if seen ~= ARGV[5 * i - 2] then
      fresh = false
      break
    end
  end
end
if not fresh then
  local reply = {0, time[1], time[2]}
  for i = 1, #KEYS do
    local held = redis.call('HMGET', KEYS[i], 'v', 'n', 't')
    reply[#reply + 1] = held[1]
    reply[#reply + 1] = held[2]
    reply[#reply + 1] = held[3]
  end
  return reply
end
for i = 1, #KEYS do
  if ARGV[5 * i] ~= '' then
    redis.call('HSET', KEYS[i], 'n', ARGV[5 * i - 1], 'v', ARGV[5 * i], 't', ARGV[5 * i + 2])
    redis.call('PEXPIRE', KEYS[i], ARGV[5 * i + 1])
  end
end
return {1, time[1], time[2]}
