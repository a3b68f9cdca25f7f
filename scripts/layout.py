#!/usr/bin/env python3
"""The README's layout: one line per module of every crate, from the
module's own first sentence (its `//!` doc), so the two cannot drift.

    scripts/layout.py           print the tree
    scripts/layout.py --write   put it in README.md between the markers
    scripts/layout.py --check   fail if README.md's tree is not the current one
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- layout: begin (scripts/layout.py --write) -->", "<!-- layout: end -->"

# The crates and folders, in the order a reader meets them: what decides,
# the two builds around it, the wire, the service, then what tests and
# measures them. Each entry: (folder, Cargo package or None, one line).
CRATES = [
    ("core", "floodgate-core", "everything the limiter decides, as plain Rust behind small traits; no proxy"),
    ("filter-common", "floodgate-filter-common", "what both builds do around a decision: a request's path, the quota client, metric names"),
    ("filter", "floodgate-filter", "the wasm build: the only code that imports `proxy_wasm`"),
    ("native", "floodgate-native", "the native build, an Envoy dynamic module: the only code that touches its ABI"),
    ("protocol", "floodgate-protocol", "the quota service's wire types, serde only"),
    ("quota", "floodgate-quota", "the quota service: fleet-wide limits in memory, Redis or Redis Cluster"),
    ("chart", "floodgate-chart", "the SVG charts of the plots and the fleet simulation"),
    ("tests", "floodgate-e2e", "end-to-end tests against a real Envoy, and the one harness of every suite and bench"),
    ("bench", "floodgate-bench", "the filter benchmark (`make filter-bench`)"),
    ("sim", "floodgate-fleet-sim", "the fleet simulation (`make fleet-sim`)"),
    ("fuzz", None, "`cargo fuzz` targets: config parsing, descriptor extraction, stored state"),
]

# The longest a module's line may grow before its sentence is cut.
MAX_LINE = 150

# Folders without Rust, one line each.
OTHER = [
    ("envoy/", "Envoy bootstraps: the wasm demo, global mode, the native build's demos (each checked with `envoy --mode validate` by the tests)"),
    ("quota/examples/", "the service's sample limits, Envoy's `ratelimit` and `rate_limit_quota` filters against it"),
    ("deploy/", "the docker compose demo, the Istio manifests, the wasm image's Dockerfile, and their tests"),
    ("docs/", "the quota protocol, the algorithms' bounds, benchmark results, Envoy's attributes as measured, the pictures"),
    ("scripts/", "the import-loop check (`make lint`), this layout, and the exports `make wasm` keeps in the module"),
]

# Source folders walked in each crate, in this order.
FOLDERS = ["src", "tests", "benches", "examples", "fuzz_targets", "noop-filter/src", "probe-filter/src", "noop-native/src"]


def first_sentence(path):
    """The first sentence of a file's `//!` doc (or of its first `///` on
    the module declaration for files without one)."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            s = line.strip()
            if s.startswith("//!"):
                text = s[3:].strip()
                if not text:
                    if lines:
                        break
                    continue
                lines.append(text)
            elif s.startswith("#![") or not s:
                if lines:
                    break
                continue
            else:
                break
    text = " ".join(lines)
    # The sentence ends at a full stop followed by a space or the end
    # (not inside "e.g." or "i.e.").
    m = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    sentence = (text[: m.start()] if m else text).strip()
    if len(sentence) > MAX_LINE:
        cut = max(sentence.rfind("; ", 0, MAX_LINE), sentence.rfind(", ", 0, MAX_LINE), sentence.rfind(": ", 0, MAX_LINE))
        sentence = sentence[: cut if cut > 40 else MAX_LINE].rstrip(",;: ") + " …"
    return sentence or "(no module doc)"


def tree(folder):
    out = []
    base = os.path.join(ROOT, folder)
    for sub in FOLDERS:
        top = os.path.join(base, sub)
        if not os.path.isdir(top):
            continue
        for dirpath, dirnames, filenames in sorted(os.walk(top)):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith(".rs"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, base)
                out.append((rel, first_sentence(path)))
    return out


def render():
    lines = []
    for folder, package, what in CRATES:
        if not os.path.isdir(os.path.join(ROOT, folder)):
            continue
        head = f"{folder}/" + (f" — `{package}`" if package else "") + f": {what}"
        lines.append(head)
        for rel, sentence in tree(folder):
            lines.append(f"    {rel} — {sentence}")
    for folder, what in OTHER:
        lines.append(f"{folder}: {what}")
    return "```\n" + "\n".join(lines) + "\n```\n"


def main():
    text = render()
    readme = os.path.join(ROOT, "README.md")
    if len(sys.argv) == 1:
        print(text, end="")
        return 0
    with open(readme, encoding="utf-8") as f:
        current = f.read()
    if BEGIN not in current or END not in current:
        print(f"README.md has no layout markers ({BEGIN} … {END})", file=sys.stderr)
        return 1
    start = current.index(BEGIN) + len(BEGIN)
    stop = current.index(END)
    wanted = current[:start] + "\n" + text + current[stop:]
    if sys.argv[1] == "--write":
        with open(readme, "w", encoding="utf-8") as f:
            f.write(wanted)
        return 0
    if sys.argv[1] == "--check":
        if wanted != current:
            print("README.md's layout is not the modules' own: run scripts/layout.py --write", file=sys.stderr)
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
