-- wrk script: one check per request for a `client` bucket that fill.lua
-- created (c0 … c989999, at random: well inside the first million).
math.randomseed(os.time())
request = function()
  local body = string.format('{"domain":"bench","descriptors":[[["client","c%d"]]]}', math.random(0, 989999))
  return wrk.format("POST", "/v1/check", {["Content-Type"] = "application/json"}, body)
end
