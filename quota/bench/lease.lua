-- wrk script: one lease per request, 100 distinct tenants in turn, each
-- lease with an id of its own (`setup` numbers the threads to keep ids apart).
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

local n = 0
request = function()
  n = n + 1
  local body = string.format(
    '{"domain":"bench","leases":[{"id":"w%d-%d","descriptor":[["tenant","t%d"]],"wanted":100,"rate":100}]}',
    thread_id or 0, n, n % 100)
  return wrk.format("POST", "/v1/lease", {["Content-Type"] = "application/json"}, body)
end
