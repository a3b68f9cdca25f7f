-- wrk script: LEASES leases per call (env, default 1), each of a `tenant`
-- bucket of its own among 10,000 and with an id of its own: `setup`
-- numbers the threads, and the run's start time keeps ids of one row apart
-- from another's and from the last round's (a lease record lives 31 s; an
-- id leased again for another bucket would be refused with 422).
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

local per_call = tonumber(os.getenv("LEASES") or "1")
local run = string.format("%x", os.time())
local n = 0
request = function()
  n = n + 1
  local leases = {}
  for i = 1, per_call do
    leases[i] = string.format('{"id":"m%s-%d-%d-%d","descriptor":[["tenant","t%d"]],"wanted":100,"rate":100}',
      run, thread_id or 0, n, i, (n * per_call + i) % 10000)
  end
  local body = '{"domain":"bench","leases":[' .. table.concat(leases, ",") .. ']}'
  return wrk.format("POST", "/v1/lease", {["Content-Type"] = "application/json"}, body)
end
