-- wrk script: fills the memory store. Each check names 32 new `client`
-- buckets (c0, c1, … in order, 32 per request); the thread stops after
-- FILL_CHECKS requests (default 31,250: 1,000,000 buckets).
local n = -1
local total = tonumber(os.getenv("FILL_CHECKS")) or 31250
request = function()
  n = n + 1
  local parts = {}
  for i = 0, 31 do
    parts[#parts + 1] = string.format('[["client","c%d"]]', n * 32 + i)
  end
  local body = '{"domain":"bench","descriptors":[' .. table.concat(parts, ",") .. ']}'
  return wrk.format("POST", "/v1/check", {["Content-Type"] = "application/json"}, body)
end
response = function()
  if n >= total then
    wrk.thread:stop()
  end
end
