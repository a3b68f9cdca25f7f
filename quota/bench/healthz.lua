-- wrk script: the service's HTTP path with no store work (GET /healthz):
-- the reference the memory check row is divided by in the targets table.
request = function()
  return wrk.format("GET", "/healthz")
end
