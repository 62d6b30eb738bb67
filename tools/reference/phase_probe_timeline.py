"""Phases of instrumented kernels from a -DDSV4_CUDA_PHASE_PROBE=ON build's output (ops/cuda/phase_probe.cuh):
each `phase_probe NAME call=N grid=X,Y block=B start_ns=S end_ns=E cycles= c1 c2 ...` line is one probe's marks in
SM cycles from its start. Prints the lines in start order on one time axis (µs from the first; "mark 1" is the
first mark on that axis, for a PDL kernel the moment its wait returned), each mark converted
to µs with the SM clock (estimated from the lines themselves: last mark cycles over end − start), then per probe
name the median of every mark across the lines whose grid matches --grid.

    dsv4 bench latency ... 2>&1 | tee run.log;  python3 tools/reference/phase_probe_timeline.py run.log --grid 1
"""
import argparse
import re
import statistics
import sys

LINE = re.compile(r"phase_probe (\S+) call=(\d+) grid=(\d+),(\d+) block=(\d+) start_ns=(\d+) end_ns=(\d+) cycles=([\d ]*)")


def parse(lines):
    probes = []
    for line in lines:
        m = LINE.search(line)
        if not m:
            continue
        name, call, gx, gy, block, start, end, cycles = m.groups()
        probes.append({"name": name, "call": int(call), "grid": (int(gx), int(gy)), "block": int(block),
                       "start": int(start), "end": int(end), "cycles": [int(c) for c in cycles.split()]})
    return probes


def clock_ghz(probes):
    """SM cycles per ns: the last mark is taken just before the end stamp, so cycles / (end − start) per line."""
    rates = [p["cycles"][-1] / (p["end"] - p["start"]) for p in probes
             if p["cycles"] and p["end"] - p["start"] >= 1000]
    if not rates:
        raise SystemExit("no probe line lasts 1 µs or more: give --clock-ghz")
    return statistics.median(rates)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--grid", type=int, help="summarise only lines whose grid.x is this (e.g. 1 token)")
    parser.add_argument("--clock-ghz", type=float, help="SM clock, instead of the estimate")
    parser.add_argument("--timeline", type=int, default=40, help="lines of the time-ordered listing (0: none)")
    args = parser.parse_args()
    with open(args.log, errors="replace") as f:
        probes = parse(f)
    if not probes:
        raise SystemExit(f"no phase_probe lines in {args.log}")
    ghz = args.clock_ghz or clock_ghz(probes)
    print(f"{len(probes)} probe lines, SM clock {ghz:.3f} GHz" + ("" if args.clock_ghz else " (estimated)"))
    probes.sort(key=lambda p: p["start"])
    origin = probes[0]["start"]
    if args.timeline:
        print(f"{'start µs':>9} {'mark 1':>8} {'end µs':>8}  {'probe':<26} {'call':>6} {'grid':>8}  marks (µs from start)")
        for p in probes[:args.timeline]:
            marks = " ".join(f"{c / ghz / 1000:.2f}" for c in p["cycles"])
            first = (p["start"] - origin) / 1000 + (p["cycles"][0] / ghz / 1000 if p["cycles"] else 0.0)
            print(f"{(p['start'] - origin) / 1000:9.2f} {first:8.2f} {(p['end'] - origin) / 1000:8.2f}  {p['name']:<26} "
                  f"{p['call']:6d} {p['grid'][0]:>4},{p['grid'][1]:<3}  {marks}")
    selected = [p for p in probes if args.grid is None or p["grid"][0] == args.grid]
    print(f"\nmedian marks, µs from each probe's start ({len(selected)} lines"
          + (f", grid.x = {args.grid}" if args.grid is not None else "") + ")")
    for name in sorted({p["name"] for p in selected}):
        rows = [p for p in selected if p["name"] == name]
        marks = max(len(p["cycles"]) for p in rows)
        medians = []
        for i in range(marks):
            values = [p["cycles"][i] / ghz / 1000 for p in rows if len(p["cycles"]) > i]
            medians.append(f"{statistics.median(values):.2f}")
        total = statistics.median((p["end"] - p["start"]) / 1000 for p in rows)
        print(f"  {name:<26} n={len(rows):<4} marks {' '.join(medians)}  (start to end {total:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
