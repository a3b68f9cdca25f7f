#!/usr/bin/env python3
"""Keeps only the listed exports of a wasm module, in place:

    scripts/wasm-exports.py MODULE KEEP_LIST

Envoy's proxy-wasm host calls into the VM for each callback a module
exports and skips one it does not export. The Rust SDK exports every
callback, so a filter pays a VM entry for each it leaves at the default:
per request (`proxy_on_log`) and per body chunk. KEEP_LIST holds one name
a line (`#` starts a comment). A name it lists that the module does not
export is an error, as is a module that is not wasm; the rest of the
module is copied byte for byte. Running it again changes nothing.
"""
import os
import sys

EXPORT_SECTION = 7


def leb128(data, at):
    """The unsigned LEB128 at `at`: (value, the offset after it)."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def to_leb128(value):
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def exports(body):
    """The export section's entries: (name, the entry's bytes)."""
    count, at = leb128(body, 0)
    for _ in range(count):
        start = at
        length, at = leb128(body, at)
        name = body[at : at + length].decode()
        _index, at = leb128(body, at + length + 1)  # after the kind byte
        yield name, body[start:at]


def keep_only(module, keep):
    """`module` with only the exports named in `keep`; the names it exports."""
    if module[:4] != b"\0asm":
        raise ValueError("not a wasm module")
    out, at, exported = bytearray(module[:8]), 8, []
    while at < len(module):
        section = module[at]
        size, start = leb128(module, at + 1)
        if start + size > len(module):
            raise ValueError("a section runs past the end")
        body = module[start : start + size]
        if section == EXPORT_SECTION:
            entries = list(exports(body))
            exported = [name for name, _ in entries]
            kept = [entry for name, entry in entries if name in keep]
            body = to_leb128(len(kept)) + b"".join(kept)
        out += bytes([section]) + to_leb128(len(body)) + body
        at = start + size
    return bytes(out), exported


def main():
    path, list_path = sys.argv[1:3]
    with open(list_path) as f:
        keep = {line.split("#")[0].strip() for line in f} - {""}
    with open(path, "rb") as f:
        try:
            module, exported = keep_only(f.read(), keep)
        except (ValueError, IndexError, UnicodeDecodeError):
            sys.exit(f"{path} is not a whole wasm module")
    missing = sorted(keep - set(exported))
    if missing:
        sys.exit(f"{path} does not export {', '.join(missing)} (listed in {list_path})")
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        f.write(module)
    os.replace(temporary, path)
    dropped = sorted(set(exported) - keep)
    print(f"{path}: {len(keep)} exports kept, {len(dropped)} dropped ({', '.join(dropped) or 'none'})")


if __name__ == "__main__":
    main()
