-- Shared by every Floodgate quota script (prepended to each).
--
-- Lua numbers in Redis are doubles, exact for integers below 2^53. Times are
-- microseconds since the Unix epoch (about 1.8e15 today), limits are at most
-- 1e9 and lease lifetimes at most 60 s, so every product below stays exact
-- except a token bucket's refill after very long idle periods on huge rules,
-- which only decides "full" anyway. Stored numbers are written with
-- string.format('%d') because tostring() would print 1.7e+15.
--
-- A bucket is a hash with two fields, a and b:
--   token bucket (algorithm 1): a = whole tokens held, b = credited-until (µs)
--   fixed window (algorithm 2): a = window index (now // period), b = units used
-- The same functions as floodgate_core::algorithm, line for line, so the
-- memory and Redis stores decide identically.

local NEVER = -1

local function now_us(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  -- Redis's own clock: every service instance sharing this Redis agrees.
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- floor(a / b) for non-negative integers; the double division may round up
-- to the next integer, so correct it.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

local function cdiv(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end

local function load(key)
  local v = redis.call('HMGET', key, 'a', 'b')
  if not v[1] and not v[2] then return nil end
  local a, b = tonumber(v[1]), tonumber(v[2])
  if a == nil or b == nil then
    error('floodgate: undecodable bucket state at key ' .. key)
  end
  return {a, b}
end

local function tb_refill(s, now, L, P, C)
  if s == nil or s[1] >= C then return {C, now} end
  if now < s[2] then return s end -- the clock stepped back: credit nothing
  local elapsed = now - s[2]
  local earned = idiv(elapsed * L, P)
  if s[1] + earned >= C then return {C, now} end
  -- advance only by the time the whole tokens took; the rest carries over
  local spent = cdiv(earned * P, L)
  if spent > elapsed then spent = elapsed end
  return {s[1] + earned, s[2] + spent}
end

local function tb_report(s, now, L, P, C, allowed, retry)
  local reset = 0
  if s[1] < C then reset = math.max(0, s[2] + cdiv(P, L) - now) end
  return {allowed, s[1], reset, retry}
end

-- The stored window is the current one, or the next one after the clock
-- stepped back across a boundary (it keeps its count, as in floodgate-core);
-- anything else starts afresh.
local function fw_current(s, now, P)
  local w = idiv(now, P)
  if s == nil or (s[1] ~= w and s[1] ~= w + 1) then return {w, 0} end
  return s
end

local function fw_report(s, L, left, allowed, retry)
  local reset = left
  if s[2] == 0 then reset = 0 end
  return {allowed, math.max(0, L - s[2]), reset, retry}
end

-- Returns the decision {allowed, remaining, reset, retry_after} and the state after it.
local function decide(algo, s, now, L, P, C, cost)
  if algo == 1 then
    s = tb_refill(s, now, L, P, C)
    if s[1] >= cost then
      local after = {s[1] - cost, s[2]}
      return tb_report(after, now, L, P, C, 1, 0), after
    end
    local retry = NEVER
    if cost <= C then retry = math.max(0, s[2] + cdiv((cost - s[1]) * P, L) - now) end
    return tb_report(s, now, L, P, C, 0, retry), s
  end
  s = fw_current(s, now, P)
  local left = (s[1] + 1) * P - now
  if s[2] + cost <= L then
    local after = {s[1], s[2] + cost}
    return fw_report(after, L, left, 1, 0), after
  end
  local retry = left
  if cost > L then retry = NEVER end
  return fw_report(s, L, left, 0, retry), s
end

-- Writes a state and lets the key expire once it is idle (a full bucket, a
-- past window), plus a second of slack for clock differences.
local function save(key, algo, s, now, L, P, C)
  redis.call('HSET', key, 'a', string.format('%d', s[1]), 'b', string.format('%d', s[2]))
  local idle_in
  if algo == 1 then
    idle_in = math.max(0, s[2] + cdiv((C - s[1]) * P, L) - now)
  else
    idle_in = math.max(0, (s[1] + 1) * P - now)
  end
  redis.call('PEXPIRE', key, string.format('%d', cdiv(idle_in, 1000) + 1000))
end

-- Mirror of floodgate_quota::grant::grant_cap.
local function grant_cap(remaining, C, horizon, ttl)
  if remaining <= 0 then return 0 end
  local half = cdiv(remaining, 2)
  if remaining * 10 >= C then return half end
  local paced = cdiv(remaining * ttl, math.max(horizon, 1))
  if paced < 1 then paced = 1 end
  return math.min(half, paced)
end
