"""Sums an `ncu --csv --metrics gpu__time_duration.sum` log per kernel name: the kernels of a profiled run, longest
first, with their count and share (docs/PERF.md's "kernel by kernel" tables are made this way).

    python3 tools/reference/ncu_summary.py ncu.csv [top]
"""
import collections
import csv
import sys


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not CSV rows
    total_us = collections.defaultdict(float)
    count = collections.Counter()
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        us = value / 1000.0 if unit in ("ns", "nsecond") else value * 1e6 if unit in ("s", "second") else value
        name = row["Kernel Name"].split("(")[0][:90]
        total_us[name] += us
        count[name] += 1
    grand = sum(total_us.values())
    print(f"{sum(count.values())} kernels, {grand:.1f} us in all")
    for name, us in sorted(total_us.items(), key=lambda item: -item[1])[:top]:
        print(f"{us:10.1f} us {100 * us / grand:5.1f} % {count[name]:5d}x  {name}")


if __name__ == "__main__":
    main()
