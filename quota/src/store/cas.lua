-- cas: write several keys only if none changed since they were read.
-- Each key is a hash: v = the value (bytes decided by the service), t = its
-- tag byte (absent on values stored before values carried one), n = its
-- version (random, chosen by the writer; absent = the key is absent).
-- KEYS[i]  a key read for the decision (all in one domain's hash tag)
-- ARGV[5i-4]  the version read ('' = the key was absent)
-- ARGV[5i-3]  the new version, ARGV[5i-2] the new value ('' = leave the key
--             as it is, only check it), ARGV[5i-1] its time to live in ms,
--             ARGV[5i] its tag
-- Returns  1 when written, 0 when a key changed (nothing written: read again).
for i = 1, #KEYS do
  local seen = redis.call('HGET', KEYS[i], 'n') or ''
  if seen ~= ARGV[5 * i - 4] then return 0 end
end
for i = 1, #KEYS do
  if ARGV[5 * i - 2] ~= '' then
    redis.call('HSET', KEYS[i], 'n', ARGV[5 * i - 3], 'v', ARGV[5 * i - 2], 't', ARGV[5 * i])
    redis.call('PEXPIRE', KEYS[i], ARGV[5 * i - 1])
  end
end
return 1
