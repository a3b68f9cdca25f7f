-- wrk script: the big-call fairness probe, a call of one lease on a key of
-- its own (a fresh `tenant` bucket each time), with an id of its own.
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

local run = string.format("%x", os.time())
local n = 0
request = function()
  n = n + 1
  local body = string.format('{"domain":"bench","leases":[{"id":"q%s-%d-%d","descriptor":[["tenant","q%s-%d-%d"]],' ..
    '"wanted":10}]}', run, thread_id or 0, n, run, thread_id or 0, n)
  return wrk.format("POST", "/v1/lease", {["Content-Type"] = "application/json"}, body)
end
