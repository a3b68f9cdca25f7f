-- lease: take a batch of tokens from each bucket, sized by grant_cap.
-- KEYS[i]  the bucket of lease i (all share the domain's hash tag)
-- ARGV[1]  now in µs, or '' to use Redis's clock
-- ARGV[2]  lease lifetime in µs
-- ARGV[3 + 5(i-1) ..]  per lease: algorithm, limit, period µs, capacity,
--          wanted (the service's target for this caller)
-- Returns  {now, then per lease: granted, remaining after, reset µs,
--           window index (0 for a token bucket), valid µs}
-- Leases are taken one after the other, so two leases of one bucket in a
-- call both see what the first took.
local now = now_us(ARGV[1])
local ttl = tonumber(ARGV[2])
local out = {now}
for i = 1, #KEYS do
  local b = 2 + (i - 1) * 5
  local algo, L, P, C, want = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
    tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
  local s = load(KEYS[i])
  local remaining, horizon, window, valid
  if algo == 1 then
    s = tb_refill(s, now, L, P, C)
    remaining, horizon, window, valid = s[1], P, 0, ttl
  else
    s = fw_current(s, now, P)
    remaining = math.max(0, L - s[2])
    horizon = (s[1] + 1) * P - now
    window, valid = s[1], math.min(ttl, horizon)
  end
  local grant = math.min(want, grant_cap(remaining, C, horizon, ttl))
  local d, after = decide(algo, s, now, L, P, C, grant)
  if grant > 0 then save(KEYS[i], algo, after, now, L, P, C) end
  out[#out + 1] = grant
  out[#out + 1] = d[2]
  out[#out + 1] = d[3]
  out[#out + 1] = window
  out[#out + 1] = valid
end
return out
