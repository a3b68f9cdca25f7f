-- wrk script: one check per request for a `client` bucket never seen before
-- (refused with 503 `full` by a full memory store).
local n = 0
request = function()
  n = n + 1
  local body = string.format('{"domain":"bench","descriptors":[[["client","new%d"]]]}', n)
  return wrk.format("POST", "/v1/check", {["Content-Type"] = "application/json"}, body)
end
