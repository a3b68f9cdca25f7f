-- wrk script: one check per request for a `client` bucket that fill.py
-- created (c0 … c999999, at random).
math.randomseed(os.time())
request = function()
  local body = string.format('{"domain":"bench","descriptors":[[["client","c%d"]]]}', math.random(0, tonumber(os.getenv("BUCKETS") or "1000000") - 1))
  return wrk.format("POST", "/v1/check", {["Content-Type"] = "application/json"}, body)
end
