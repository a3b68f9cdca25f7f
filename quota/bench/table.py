"""Prints the quota benchmark's table from its rows (round|label|rate|p50|p99
|non-2xx): per row the medians over the rounds, with the range of the rate
and of p99, and the ratios the service's targets are stated in, each the
median of the per-round ratios (rows of one round ran within a minute or
two of each other, so the ratios mean more than the absolute figures on a
shared machine).

Usage: table.py ROWS"""

import statistics
import sys


def ms(text):
    for unit, factor in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float("nan")


rounds = {}
for line in open(sys.argv[1]):
    r, label, rate, p50, p99, errors = line.rstrip("\n").split("|")
    rounds.setdefault(r, {})[label] = (float(rate or "nan"), ms(p50), ms(p99), int(errors or 0))
labels = []
for rows in rounds.values():
    labels += [label for label in rows if label not in labels]
med = statistics.median

print(f"{'median of ' + str(len(rounds)) + ' rounds':36} {'decisions/s':>11} {'(range)':>17} {'p50 ms':>7} {'p99 ms':>7} {'(range)':>13} {'non-2xx':>8}")
for label in labels:
    rows = [rnd[label] for rnd in rounds.values() if label in rnd]
    rates, p99s = [x[0] for x in rows], [x[2] for x in rows]
    print(f"{label:36} {med(rates):11.0f} {min(rates):8.0f}-{max(rates):<8.0f} {med([x[1] for x in rows]):7.2f}"
          f" {med(p99s):7.2f} {min(p99s):6.2f}-{max(p99s):<6.2f} {sum(x[3] for x in rows):8}")


def ratio(top, bottom, column):
    """Median over the rounds of top's figure over bottom's."""
    values = [rnd[top][column] / rnd[bottom][column] for rnd in rounds.values() if top in rnd and bottom in rnd]
    return med(values) if values else float("nan")


def verdict(ok):
    return "met" if ok else "MISSED"


def medians(label, column):
    values = [rnd[label][column] for rnd in rounds.values() if label in rnd]
    return med(values) if values else float("nan")


print()
print(f"{'target (issue 16)':58} {'measured':>10}  verdict")
memory = medians("memory check", 0)
print(f"{'memory checks/s on one service core >= 100,000':58} {memory:10.0f}  {verdict(memory >= 100_000)}")
if any("memory healthz (HTTP, no store)" in rnd for rnd in rounds.values()):
    # The service's HTTP path with no store work: what the core serves at all.
    value = medians("memory healthz (HTTP, no store)", 0)
    print(f"{'  beside it: GET /healthz/s, same connections and core':58} {value:10.0f}  (reference)")
    value = ratio("memory check", "memory healthz (HTTP, no store)", 0)
    print(f"{'  memory checks / GET /healthz (HTTP path share)':58} {value:10.2f}  (measured)")
for store in ("redis", "redis-cluster"):
    for call, floor in (("check", 0.6), ("lease", 0.5)):
        value = ratio(f"{store} {call}", f"memory {call}", 0)
        print(f"{f'{store} {call}s / memory {call}s >= {floor}':58} {value:10.2f}  {verdict(value >= floor)}")
value = ratio("memory 10^6 full, existing", "memory 10^6 room, existing", 2)
print(f"{'full store p99 / store with room p99 (existing buckets) <= 1.5':58} {value:10.2f}  {verdict(value <= 1.5)}")
value = ratio("memory RLS gRPC, one key (h2load)", "memory check, one key (h2load)", 0)
print(f"{'RLS gRPC / /v1/check, same key and load generator (rate)':58} {value:10.2f}  (measured)")
value = ratio("memory RLS gRPC, one key (h2load)", "memory check, one key (h2load)", 2)
print(f"{'RLS gRPC / /v1/check (p99)':58} {value:10.2f}  (measured)")
for label in labels:
    if label.startswith("memory (") and label.endswith(" check"):
        value = ratio(label, "memory check", 0)
        print(f"{label + ' / memory check (rate)':58} {value:10.2f}  (comparison)")
        value = ratio(label, label[: -len("check")] + "healthz (HTTP, no store)", 0)
        print(f"{label + ' / its GET /healthz (rate)':58} {value:10.2f}  (comparison)")
    if label.startswith("redis (") and label.endswith(" check"):
        value = ratio(label, "redis check", 0)
        print(f"{label + ' / redis check (rate)':58} {value:10.2f}  (comparison)")
        value = ratio(label, "memory check", 0)
        print(f"{label + ' / memory check (rate)':58} {value:10.2f}  (comparison)")
    if label.startswith("redis (") and label.endswith(" lease"):
        value = ratio(label, "redis lease", 0)
        print(f"{label + ' / redis lease (rate)':58} {value:10.2f}  (comparison)")
        value = ratio(label, "memory lease", 0)
        print(f"{label + ' / memory lease (rate)':58} {value:10.2f}  (comparison)")

print()
print(f"{'issue 22: leases per second (one service core)':58} {'measured':>10}")
compared = [label[: -len(" leases, 10 per call")] for label in labels
            if label.startswith("redis (") and label.endswith(" leases, 10 per call")]
for store in ("memory", "redis", *compared):
    for per_call in (1, 10, 200):
        label = f"{store} leases, {per_call} per call"
        if any(label in rnd for rnd in rounds.values()):
            print(f"{label:58} {medians(label, 0):10.0f}  (measured)")
print()
print(f"{'issue 22: hot-key fairness (probe p99 flooded / alone <= 3, 0 failures)':58} {'measured':>10}  verdict")
compared = [label[: -len(" fairness probe, alone")] for label in labels
            if label.startswith("redis (") and label.endswith(" fairness probe, alone")]
for store in ("memory", "redis", *compared):
    alone, flooded = f"{store} fairness probe, alone", f"{store} fairness probe, hot key flooded"
    value = ratio(flooded, alone, 2)
    failures = sum(rnd[flooded][3] + rnd[alone][3] for rnd in rounds.values() if flooded in rnd and alone in rnd)
    ok = value <= 3 and failures == 0
    print(f"{store + ' probe p99 ratio, failures ' + str(failures):58} {value:10.2f}  {verdict(ok)}")
print()
print(f"{'issue 34: big-call fairness (one-lease probe p99 with 512-lease calls / alone <= 3, 0 failures)':58}")
for store in ("memory", "redis"):
    alone, flooded = f"{store} big calls: probe, alone", f"{store} big calls: probe, 512-lease calls"
    if not any(alone in rnd for rnd in rounds.values()):
        continue
    value = ratio(flooded, alone, 2)
    failures = sum(rnd[flooded][3] + rnd[alone][3] for rnd in rounds.values() if flooded in rnd and alone in rnd)
    ok = value <= 3 and failures == 0
    print(f"{store + ' probe p99 ratio, failures ' + str(failures):58} {value:10.2f}  {verdict(ok)}")
