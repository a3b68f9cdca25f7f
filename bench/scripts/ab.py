#!/usr/bin/env python3
"""A/B of two Floodgate modules on the bench's rows, in alternating rounds.

    python3 bench/scripts/ab.py BASE.wasm NEW.wasm [ROUNDS]

Each round runs the bench's throughput part once with BASE, then once with
NEW (then NEW first in the next round, so neither always follows the
other), for the rows in BENCH_VARIANTS (default: the local rows and their
no-op reference). Prints, per row, the median req/s of each module over the
rounds, NEW / BASE per round, and that ratio's median and spread. Every
other setting is the bench's own (bench/README.md); the harness and the
quota service are the ones `make -f bench/bench.mk filter-bench-build` built.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

base, new = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
variants = os.environ.get("BENCH_VARIANTS", "c,d,d2,e,f,db,dk,dt,i")
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
release = os.path.join(root, "target", "wasm32-wasip1", "release")


def run(module):
    with tempfile.TemporaryDirectory() as results:
        env = dict(os.environ, FLOODGATE_WASM=os.path.abspath(module), BENCH_ROUNDS="1",
                   BENCH_PARTS="throughput", BENCH_VARIANTS=variants, BENCH_RESULTS_DIR=results,
                   NOOP_WASM=os.path.join(release, "floodgate_bench_noop.wasm"),
                   PROBE_WASM=os.path.join(release, "floodgate_bench_probe.wasm"),
                   QUOTA_BIN=os.path.join(root, "target", "release", "floodgate-quota"))
        subprocess.run(["cargo", "run", "--quiet", "--release", "-p", "floodgate-bench"], cwd=root, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        (name,) = os.listdir(results)
        with open(os.path.join(results, name)) as f:
            report = json.load(f)
    return {v["id"]: v["median"]["rps"] for v in report["throughput"]["variants"]}, report["machine"]


seen = {"base": [], "new": []}
machine = None
for r in range(rounds):
    order = [("base", base), ("new", new)] if r % 2 == 0 else [("new", new), ("base", base)]
    for label, module in order:
        rps, machine = run(module)
        seen[label].append(rps)
        print(f"round {r + 1} {label}: " + ", ".join(f"{k} {v:,.0f}" for k, v in rps.items()), flush=True)

print(f"\nmachine: {machine}")
print(f"{'row':<5} {'base req/s':>11} {'new req/s':>11} {'new/base median':>16} {'min':>6} {'max':>6}")
for row in seen["base"][0]:
    b = [rnd[row] for rnd in seen["base"]]
    n = [rnd[row] for rnd in seen["new"]]
    ratios = [x / y for x, y in zip(n, b)]
    print(f"{row:<5} {statistics.median(b):>11,.0f} {statistics.median(n):>11,.0f} "
          f"{statistics.median(ratios):>16.3f} {min(ratios):>6.3f} {max(ratios):>6.3f}")
