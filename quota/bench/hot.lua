-- wrk script: the hot key, flooded: a check of one `user` bucket per request.
local body = '{"domain":"bench","descriptors":[[["user","hot"]]],"hits":1}'
request = function()
  return wrk.format("POST", "/v1/check", {["Content-Type"] = "application/json"}, body)
end
