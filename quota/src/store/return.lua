-- return: give back unused leased tokens.
-- KEYS[i]  the bucket of item i (all share the domain's hash tag)
-- ARGV[1]  now in µs, or '' to use Redis's clock
-- ARGV[2 + 6(i-1) ..]  per item: algorithm, limit, period µs, capacity,
--          tokens, window index from the lease (ignored for a token bucket)
-- Returns  {now, then per item: tokens actually taken back}
-- A fixed window takes tokens back only into the window they were leased
-- from (a later window never saw them); a token bucket never beyond full.
local now = now_us(ARGV[1])
local out = {now}
for i = 1, #KEYS do
  local b = 1 + (i - 1) * 6
  local algo, L, P, C, tokens, window = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
    tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
  local s = load(KEYS[i])
  local back = 0
  if s ~= nil then
    if algo == 1 then
      s = tb_refill(s, now, L, P, C)
      back = math.min(tokens, C - s[1])
      if back > 0 then
        s = {s[1] + back, s[2]}
        if s[1] >= C then s = {C, now} end
        save(KEYS[i], algo, s, now, L, P, C)
      end
    elseif s[1] == idiv(now, P) and s[1] == window then
      back = math.min(tokens, s[2])
      if back > 0 then save(KEYS[i], algo, {s[1], s[2] - back}, now, L, P, C) end
    end
  end
  out[#out + 1] = back
end
return out
