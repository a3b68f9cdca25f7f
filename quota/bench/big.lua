-- wrk script: the big-call flood, calls of 512 leases (the most a call may
-- carry), each of a fresh `tenant` bucket and with an id of its own. The
-- body is a template written once; each request fills in its prefix with
-- one gsub (C, not 512 string operations in Lua: wrk shares its core with
-- Redis, which the Lua would slow).
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

local leases = {}
for i = 1, 512 do
  leases[i] = '{"id":"@' .. i .. '","descriptor":[["tenant","@' .. i .. '"]],"wanted":10}'
end
local template = '{"domain":"bench","leases":[' .. table.concat(leases, ",") .. ']}'
local run = string.format("%x", os.time())
local n = 0
request = function()
  n = n + 1
  local prefix = string.format("g%s-%d-%d-", run, thread_id or 0, n)
  local body = template:gsub("@", prefix)
  return wrk.format("POST", "/v1/lease", {["Content-Type"] = "application/json"}, body)
end
