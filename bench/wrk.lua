-- The one wrk script every throughput variant runs, so its cost is the same
-- for all of them. Requests cycle through a set of API keys (one bucket each
-- in the limiting variants): 16, or as many as the script's first argument
-- says (`wrk ... URL -- 1000`). They are formatted once in init(), so the
-- per-request Lua work is an index and a table lookup.
local key_count = 16
local prepared = {}
local next_index = 0

function init(args)
  key_count = tonumber(args[1]) or key_count
  for i = 1, key_count do
    prepared[i] = wrk.format("GET", nil, {["x-api-key"] = string.format("key-%02d", i - 1)})
  end
end

function request()
  next_index = next_index % key_count + 1
  return prepared[next_index]
end

-- One machine-readable line; the harness parses it (latencies in microseconds).
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH_RESULT requests=%d duration_us=%d p50_us=%d p99_us=%d status_errors=%d connect_errors=%d read_errors=%d write_errors=%d timeouts=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status, e.connect, e.read, e.write, e.timeout))
end
