"""Fills a memory store for the benchmark's 10⁶-bucket rows: checks of 32 new
`client` buckets each (c0, c1, … in order, one keep-alive connection, so
exactly these buckets exist afterwards); for the full store (`full`), one
more new bucket, which must be refused as full.

Usage: fill.py PORT BUCKETS (a multiple of 32) full|room."""

import http.client
import json
import sys

port, buckets, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)


def check(names):
    body = json.dumps({"domain": "bench", "descriptors": [[["client", n]] for n in names]})
    connection.request("POST", "/v1/check", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


for first in range(0, buckets, 32):
    status, body = check([f"c{i}" for i in range(first, first + 32)])
    if status != 200:
        sys.exit(f"filling: buckets c{first}… refused with {status}: {body!r}")
if kind == "full":
    status, body = check(["one-too-many"])
    if status != 503 or b"full" not in body:
        sys.exit(f"the store should be full after {buckets} buckets, got {status}: {body!r}")
    print(f"full store: {buckets} buckets c0 … c{buckets - 1}, one more refused as full")
else:
    print(f"store with room: {buckets} buckets c0 … c{buckets - 1}")
