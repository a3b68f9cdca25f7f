-- wrk script: one check per request, 10,000 distinct users in turn.
local n = 0
request = function()
  n = n + 1
  local body = string.format('{"domain":"bench","descriptors":[[["user","u%d"]]],"hits":1}', n % 10000)
  return wrk.format("POST", "/v1/check", {["Content-Type"] = "application/json"}, body)
end
