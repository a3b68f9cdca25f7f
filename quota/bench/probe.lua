-- wrk script: the fairness probe, calls touching the hot key beside others
-- in turn: a check of [other, hot], a call of two leases (another key's and
-- the hot key's), the return of the hot key's lease of the call before.
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

local run = string.format("%x", os.time())
local n = 0
request = function()
  n = n + 1
  local t, step, body, path = thread_id or 0, n % 3, nil, nil
  if step == 0 then
    path = "/v1/check"
    body = string.format('{"domain":"bench","descriptors":[[["user","o%d"]],[["user","hot"]]],"hits":1}', n % 1000)
  elseif step == 1 then
    path = "/v1/lease"
    body = string.format('{"domain":"bench","leases":[' ..
      '{"id":"p%s-%d-%d-a","descriptor":[["user","o%d"]],"wanted":10},' ..
      '{"id":"p%s-%d-%d-b","descriptor":[["user","hot"]],"wanted":10}]}', run, t, n, n % 1000, run, t, n)
  else
    path = "/v1/return"
    body = string.format('{"domain":"bench","returns":[{"id":"p%s-%d-%d-b","tokens":5}]}', run, t, n - 1)
  end
  return wrk.format("POST", path, {["Content-Type"] = "application/json"}, body)
end
