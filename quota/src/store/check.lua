-- check: all-or-nothing decision over several buckets.
-- KEYS[i]  the bucket of descriptor i (all share the domain's hash tag)
-- ARGV[1]  now in µs, or '' to use Redis's clock
-- ARGV[2 + 6(i-1) ..]  per descriptor: algorithm (1 token bucket, 2 fixed
--          window), limit, period µs, capacity, cost, shadow (1 = shadow mode)
-- Returns  {now, committed (1/0), then per descriptor:
--           allowed, remaining, reset µs, retry_after µs (-1 = never)}
-- The cost is taken from every bucket only if no non-shadow bucket denies;
-- otherwise nothing is written and allowed buckets report their untouched state.
local now = now_us(ARGV[1])
local n = #KEYS
local params, states, decisions, afters = {}, {}, {}, {}
local commit = 1
for i = 1, n do
  local b = 1 + (i - 1) * 6
  local p = {}
  for j = 1, 6 do p[j] = tonumber(ARGV[b + j]) end
  params[i] = p
  states[i] = load(KEYS[i])
  decisions[i], afters[i] = decide(p[1], states[i], now, p[2], p[3], p[4], p[5])
  if decisions[i][1] == 0 and p[6] == 0 then commit = 0 end
end
local out = {now, commit}
for i = 1, n do
  local p, d = params[i], decisions[i]
  if d[1] == 1 then
    if commit == 1 then
      save(KEYS[i], p[1], afters[i], now, p[2], p[3], p[4])
    else
      d = decide(p[1], states[i], now, p[2], p[3], p[4], 0)
    end
  end
  for j = 1, 4 do out[#out + 1] = d[j] end
end
return out
