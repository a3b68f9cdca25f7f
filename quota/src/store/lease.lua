-- lease: take a batch of tokens from each bucket, sized by grant_cap, and
-- record each grant under the caller's lease id, atomically with it.
-- KEYS[2i-1]  the bucket of lease i; KEYS[2i] its record (all in the domain's hash tag)
-- ARGV[1]  now in µs, or '' to use Redis's clock
-- ARGV[2]  lease lifetime in µs
-- ARGV[3]  how long a record outlives its lease, µs
-- ARGV[4 + 5(i-1) ..]  per lease: algorithm, limit, period µs, capacity,
--          wanted (the service's target for this caller)
-- Returns  {now, then per lease: granted, remaining after, reset µs,
--           window index (0 for a token bucket), valid µs, replayed (1/0)}
-- A lease whose record exists (and has not expired at `now`: field x) is
-- answered from it and takes nothing. Leases
-- are taken one after the other, so two leases of one bucket in a call both
-- see what the first took.
local now = now_us(ARGV[1])
local ttl = tonumber(ARGV[2])
local margin = tonumber(ARGV[3])
local out = {now}
for i = 1, #KEYS / 2 do
  local key, rec = KEYS[2 * i - 1], KEYS[2 * i]
  local b = 3 + (i - 1) * 5
  local algo, L, P, C, want = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
    tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
  local s = load(key)
  local r = redis.call('HMGET', rec, 'g', 'w', 'v', 'x')
  local grant, window, valid, replayed, d
  if r[1] and tonumber(r[4]) > now then
    d = decide(algo, s, now, L, P, C, 0)
    grant, window, valid, replayed = tonumber(r[1]), tonumber(r[2]), math.max(0, tonumber(r[3]) - now), 1
  else
    local remaining, horizon
    if algo == 1 then
      s = tb_refill(s, now, L, P, C)
      remaining, horizon, window, valid = s[1], P, 0, ttl
    else
      s = fw_current(s, now, P)
      remaining = math.max(0, L - s[2])
      horizon = (s[1] + 1) * P - now
      window, valid = s[1], math.min(ttl, horizon)
    end
    grant = math.min(want, grant_cap(remaining, C, horizon, ttl))
    local after
    d, after = decide(algo, s, now, L, P, C, grant)
    replayed = 0
    if grant > 0 then
      save(key, algo, after, now, L, P, C)
      local f = function(n) return string.format('%d', n) end
      redis.call('HSET', rec, 'k', key, 'a', algo, 'L', f(L), 'P', f(P), 'C', f(C),
        'w', f(window), 'g', f(grant), 'r', 0, 'v', f(now + valid), 'x', f(now + valid + margin))
      redis.call('PEXPIRE', rec, f(cdiv(valid + margin, 1000)))
    end
  end
  out[#out + 1] = grant
  out[#out + 1] = d[2]
  out[#out + 1] = d[3]
  out[#out + 1] = window
  out[#out + 1] = valid
  out[#out + 1] = replayed
end
return out
