-- cas: write several keys only if none changed since they were read.
-- Each key is a hash: v = the value (bytes decided by the service), n = its
-- version (random, chosen by the writer; absent = the key is absent).
-- KEYS[i]  a key read for the decision (all in one domain's hash tag)
-- ARGV[4i-3]  the version read ('' = the key was absent)
-- ARGV[4i-2]  the new version, ARGV[4i-1] the new value ('' = leave the key
--             as it is, only check it), ARGV[4i] its time to live in ms
-- Returns  1 when written, 0 when a key changed (nothing written: read again).
for i = 1, #KEYS do
  local seen = redis.call('HGET', KEYS[i], 'n') or ''
  if seen ~= ARGV[4 * i - 3] then return 0 end
end
for i = 1, #KEYS do
  if ARGV[4 * i - 1] ~= '' then
    redis.call('HSET', KEYS[i], 'n', ARGV[4 * i - 2], 'v', ARGV[4 * i - 1])
    redis.call('PEXPIRE', KEYS[i], ARGV[4 * i])
  end
end
return 1
