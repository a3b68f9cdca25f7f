"""Writes the body of one gRPC `ShouldRateLimit` call to stdout: a
RateLimitRequest {domain: "bench", descriptors: [{entries: [{key: "user",
value: "u1"}]}], hits_addend: 1} in protobuf, framed as gRPC frames it (a
zero compression flag and the length, big-endian). For h2load, which sends
the same body on every request."""

import struct
import sys


def field(number, payload):
    """A length-delimited field (wire type 2)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


entry = field(1, b"user") + field(2, b"u1")
descriptor = field(1, entry)
request = field(1, b"bench") + field(2, descriptor) + bytes([3 << 3 | 0, 1])
sys.stdout.buffer.write(b"\x00" + struct.pack(">I", len(request)) + request)
