-- return: give back unused tokens of recorded leases.
-- KEYS[i]  the record of lease i (in the domain's hash tag, as the bucket it names)
-- ARGV[1]  now in µs, or '' to use Redis's clock
-- ARGV[1 + i]  tokens to give back for lease i
-- Returns  {now, then per item: tokens actually taken back}
-- A lease gives back once (field r: 1 once returned), at most what it
-- granted, so a retried return is harmless; a fixed window takes tokens back only into the window they were leased from
-- (a later window never saw them); a token bucket never beyond full. An
-- unknown or expired lease gives back 0.
local now = now_us(ARGV[1])
local out = {now}
for i = 1, #KEYS do
  local r = redis.call('HMGET', KEYS[i], 'k', 'a', 'L', 'P', 'C', 'w', 'g', 'r', 'x')
  local back = 0
  if r[1] and r[8] == '0' and tonumber(r[9]) > now then
    redis.call('HSET', KEYS[i], 'r', 1)
    local key = r[1]
    local algo, L, P, C, window = tonumber(r[2]), tonumber(r[3]), tonumber(r[4]), tonumber(r[5]), tonumber(r[6])
    local tokens = math.min(tonumber(ARGV[1 + i]), tonumber(r[7]))
    local s = load(key)
    if s ~= nil and tokens > 0 then
      if algo == 1 then
        s = tb_refill(s, now, L, P, C)
        back = math.min(tokens, C - s[1])
        if back > 0 then
          s = {s[1] + back, s[2]}
          if s[1] >= C then s = {C, now} end
          save(key, algo, s, now, L, P, C)
        end
      elseif s[1] == idiv(now, P) and s[1] == window then
        back = math.min(tokens, s[2])
        if back > 0 then save(key, algo, {s[1], s[2] - back}, now, L, P, C) end
      end
    end
  end
  out[#out + 1] = back
end
return out
