-- cas: write several keys only if none changed since the decision was made
-- on them, and (deciding on Redis's clock) only if the decision's time is
-- Redis's. Each key is a hash: v = the value (bytes decided by the
-- service), t = its tag byte (absent on values stored before values carried
-- one), n = its version (chosen by the writer; absent = the key is absent);
-- turn, turn_until = an instance that lost too many races in a row and,
-- until then (µs), the only one whose write the key takes.
-- KEYS[i]           the keys the decision was made on (one domain's hash tag)
-- ARGV[1]           the decision's time, µs since the epoch ('' = no check)
-- ARGV[2]           how far it may be from TIME, µs
-- ARGV[3]           the deciding instance
-- ARGV[4]           '1': when nothing is written, claim the keys' turn
-- ARGV[5]           how long a turn lasts, µs
-- ARGV[5 + 5i - 4]  the version the decision saw ('' = absent)
-- ARGV[5 + 5i - 3]  the new version; ARGV[5 + 5i - 2] the new value ('' =
--                   leave the key as it is, only check it); ARGV[5 + 5i - 1]
--                   its time to live in ms; ARGV[5 + 5i] its tag
-- Returns {1, seconds, µs} (TIME) when written; when a key changed, another
-- instance has its turn, or the time was off, nothing is written and it
-- returns {0, seconds, µs, v1, n1, t1, v2, n2, t2, ...}: what the keys hold,
-- to decide again on.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local fresh = ARGV[1] == '' or math.abs(now - tonumber(ARGV[1])) <= tonumber(ARGV[2])
if fresh then
  for i = 1, #KEYS do
    local held = redis.call('HMGET', KEYS[i], 'n', 'turn', 'turn_until')
    if (held[1] or '') ~= ARGV[5 + 5 * i - 4] then
      fresh = false
      break
    end
    if held[2] and held[2] ~= ARGV[3] and tonumber(held[3]) > now then
      fresh = false
      break
    end
  end
end
if not fresh then
  local reply = {0, time[1], time[2]}
  for i = 1, #KEYS do
    if ARGV[4] == '1' then
      local turn = redis.call('HMGET', KEYS[i], 'turn', 'turn_until')
      if not turn[1] or turn[1] == ARGV[3] or tonumber(turn[2]) <= now then
        redis.call('HSET', KEYS[i], 'turn', ARGV[3], 'turn_until', now + tonumber(ARGV[5]))
        -- A key held only for a turn goes when the turn does.
        if redis.call('PTTL', KEYS[i]) < 0 then
          redis.call('PEXPIRE', KEYS[i], math.ceil(tonumber(ARGV[5]) / 1000))
        end
      end
    end
    local held = redis.call('HMGET', KEYS[i], 'v', 'n', 't')
    reply[#reply + 1] = held[1]
    reply[#reply + 1] = held[2]
    reply[#reply + 1] = held[3]
  end
  return reply
end
for i = 1, #KEYS do
  if ARGV[5 + 5 * i - 2] ~= '' then
    redis.call('HSET', KEYS[i], 'n', ARGV[5 + 5 * i - 3], 'v', ARGV[5 + 5 * i - 2], 't', ARGV[5 + 5 * i])
    redis.call('PEXPIRE', KEYS[i], ARGV[5 + 5 * i - 1])
  end
  -- A turn ends with its holder's decision (any other one has run out).
  redis.call('HDEL', KEYS[i], 'turn', 'turn_until')
end
return {1, time[1], time[2]}
