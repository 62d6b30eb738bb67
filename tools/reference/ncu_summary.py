"""Sums an `ncu --csv --metrics gpu__time_duration.sum` log per kernel name: the kernels of a profiled run, longest
first, with their count and share (docs/PERF.md's "kernel by kernel" tables are made this way).

    python3 tools/reference/ncu_summary.py ncu.csv [top]
    python3 tools/reference/ncu_summary.py long.csv [top] --minus short.csv --steps N

With --minus, the per-name sums of a second, shorter run of the same command are subtracted and the difference
divided by N: two runs that differ only in N more decode steps give one decode step, kernel by kernel, without the
prefill and set-up kernels they share (bench/run_decode_profile_device.sh).
"""
import argparse
import collections
import csv


def kernel_sums(path):
    """Per kernel name (up to its argument list): total µs and launch count."""
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
    return total_us, count


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("top", nargs="?", type=int, default=30)
    parser.add_argument("--minus", help="a shorter run's csv, subtracted per kernel name")
    parser.add_argument("--steps", type=int, default=1, help="what the two runs differ by (divides the difference)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    total_us, count = kernel_sums(args.csv)
    if args.minus:
        short_us, short_count = kernel_sums(args.minus)
        total_us = {name: (total_us.get(name, 0.0) - short_us.get(name, 0.0)) / args.steps
                    for name in set(total_us) | set(short_us)}
        count = {name: (count.get(name, 0) - short_count.get(name, 0)) / args.steps for name in total_us}
        total_us = {name: us for name, us in total_us.items() if count[name] != 0 or abs(us) > 0.05}
    grand = sum(total_us.values())
    launches = sum(count[name] for name in total_us)
    unit = f" a step (over {args.steps} steps)" if args.minus else ""
    print(f"{launches:g} kernels, {grand:.1f} us in all{unit}")
    for name, us in sorted(total_us.items(), key=lambda item: -item[1])[:args.top]:
        share = 100 * us / grand if grand else 0.0
        print(f"{us:10.1f} us {share:5.1f} % {count[name]:7.2f}x  {name}")


if __name__ == "__main__":
    main()
