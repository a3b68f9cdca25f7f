-- wrk script: one lease per request, 100 distinct tenants in turn.
local n = 0
request = function()
  n = n + 1
  local body = string.format(
    '{"domain":"bench","leases":[{"descriptor":[["tenant","t%d"]],"wanted":100,"rate":100}]}', n % 100)
  return wrk.format("POST", "/v1/lease", {["Content-Type"] = "application/json"}, body)
end
