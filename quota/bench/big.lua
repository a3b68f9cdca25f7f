-- wrk script: the big-call flood, calls of 512 leases (the most a call may
-- carry), each of a fresh `tenant` bucket and with an id of its own.
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

local run = string.format("%x", os.time())
local n = 0
request = function()
  n = n + 1
  local prefix = string.format("g%s-%d-%d-", run, thread_id or 0, n)
  local leases = {}
  for i = 1, 512 do
    leases[i] = '{"id":"' .. prefix .. i .. '","descriptor":[["tenant","' .. prefix .. i .. '"]],"wanted":10}'
  end
  local body = '{"domain":"bench","leases":[' .. table.concat(leases, ",") .. ']}'
  return wrk.format("POST", "/v1/lease", {["Content-Type"] = "application/json"}, body)
end
