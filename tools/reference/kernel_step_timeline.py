"""Where the wall time of one decode step goes inside a CUDA graph, from a kernel trace (CUPTI or Nsight Systems).

ncu (tools/reference/ncu_summary.py) times each kernel alone, serialised, so its per-kernel sums overstate a step
that runs as one graph with programmatic dependent launch and side streams (1,897 µs of ncu kernel time against a
1,539 µs step, docs/PERF.md). This reads the kernels as they ran:

    DSV4_KERNEL_TRACE=trace.csv dsv4 bench latency ... --batch-size 1     (CUPTI, ops/cuda/kernel_trace.h)
    python3 tools/reference/kernel_step_timeline.py trace.csv [top] [--boundary REGEX] [--steps N]

or from Nsight Systems, where it can import its reports (the lent machines' copy cannot):

    nsys profile -o run --trace=cuda --cuda-graph-trace=node dsv4 bench latency ... --batch-size 1
    nsys stats --report cuda_gpu_trace --format csv --output run run.nsys-rep   (then run_cuda_gpu_trace.csv)

Steps are cut at the kernels whose name matches --boundary (default: the sampling kernels that end every decode
step); the last N complete steps are averaged. Each step's wall time is split exactly over its kernels: an
instant goes to the earliest-started running kernel, so a kernel launched early under PDL is charged only from
its predecessor's end (with --main-stream, the boundary kernel's stream first: a side stream's kernel then owns
only the instants the main stream waits for it); an instant with nothing running is idle (launch or dependency
latency, the host between steps), charged to the kernel that starts the next busy stretch. A kernel charged
nothing was hidden.
"""
import argparse
import collections
import csv
import re
import statistics


def column(header, *prefixes):
    for prefix in prefixes:
        for name in header:
            if name.strip().startswith(prefix):
                return name
    raise SystemExit(f"no column starting with {prefixes} in {header}")


def short_name(name):
    """The kernel's own name: no return type, namespaces, template arguments or parameters."""
    for anonymous in ("(anonymous namespace)::", "<unnamed>::"):
        name = name.replace(anonymous, "")
    name = re.sub(r"^void ", "", name.strip())
    name = re.split(r"[(<]", name, maxsplit=1)[0]
    return name.rsplit("::", 1)[-1].strip()[:80]


def read_kernels(path):
    """(start ns, end ns, stream, name) of every kernel, sorted by start; memcpy/memset rows are skipped."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.strip()]
    # nsys stats may print notices before the CSV header: start at the header.
    first = next(i for i, line in enumerate(lines) if "Start" in line and "Name" in line)
    reader = csv.DictReader(lines[first:])
    start_col = column(reader.fieldnames, "Start")
    duration_col = column(reader.fieldnames, "Duration")
    stream_col = column(reader.fieldnames, "Strm", "Stream")
    name_col = column(reader.fieldnames, "Name")
    grid_col = next((c for c in reader.fieldnames if c.strip().startswith("GrdX")), None)
    kernels = []
    for row in reader:
        if grid_col is not None and not row[grid_col].strip():
            continue  # a copy or a memset: no grid
        name = row[name_col]
        if name.startswith("[CUDA mem"):
            continue
        start = float(row[start_col].replace(",", ""))
        end = start + float(row[duration_col].replace(",", ""))
        kernels.append((start, end, row[stream_col].strip(), short_name(name)))
    kernels.sort()
    return kernels


def split_steps(kernels, boundary, merge_within=4):
    """Lists of kernels between consecutive boundary kernels (each list ends with its boundary kernel). Boundary
    kernels at most `merge_within` launches apart are one boundary (sampling is a few launches; the last counts)."""
    pattern = re.compile(boundary)
    ends = [i for i, k in enumerate(kernels) if pattern.search(k[3])]
    last_of_run = [i for j, i in enumerate(ends) if j + 1 == len(ends) or ends[j + 1] - i > merge_within]
    return [kernels[a + 1:b + 1] for a, b in zip(last_of_run, last_of_run[1:])]


def attribute(step, step_begin, main_stream=None):
    """Per kernel name: (busy µs, idle µs before it, launches) of one step, and its wall µs (step_begin to the
    last end). Every instant of the wall goes to one kernel: the earliest-started of those running then (a kernel
    launched early under PDL waits while its predecessor runs: the instant is the predecessor's), preferring
    `main_stream`'s when given (a side stream's kernel then owns only instants when the main stream waits for it);
    an instant with no kernel running is idle, charged to the kernel that starts the next busy stretch. Graph
    replays may put one chain's kernels on several internal streams (CUPTI reports them so): then pass None."""
    busy = collections.defaultdict(float)
    idle = collections.defaultdict(float)
    launches = collections.Counter(name for _, _, _, name in step)
    step_end = max(end for _, end, _, _ in step)
    points = sorted({step_begin, step_end} | {t for s, e, _, _ in step for t in (s, e) if step_begin < t < step_end})
    pending_idle = 0.0
    for a, b in zip(points, points[1:]):
        running = [k for k in step if k[0] <= a and k[1] >= b]
        if not running:
            pending_idle += (b - a) / 1e3
            continue
        main = [k for k in running if main_stream is not None and k[2] == main_stream]
        owner = min(main or running)  # earliest start
        busy[owner[3]] += (b - a) / 1e3
        if pending_idle:
            first = min(k for k in running if k[0] >= a) if any(k[0] >= a for k in running) else owner
            idle[first[3]] += pending_idle
            pending_idle = 0.0
    return busy, idle, launches, (step_end - step_begin) / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("top", nargs="?", type=int, default=40)
    parser.add_argument("--main-stream", action="store_true",
                        help="prefer the boundary kernel's stream (when every step's chain runs on one stream)")
    parser.add_argument("--list", action="store_true", help="also list the last step's kernels in start order")
    parser.add_argument("--boundary", default=r"row_finish|row_decide",
                        help="regex naming the kernel(s) that end a decode step")
    parser.add_argument("--steps", type=int, default=8, help="complete steps to average, the last ones")
    args = parser.parse_args()
    kernels = read_kernels(args.csv)
    steps = split_steps(kernels, args.boundary)
    if len(steps) < 2:
        raise SystemExit(f"fewer than 2 steps cut by /{args.boundary}/ in {len(kernels)} kernels")
    # The step before each chosen one gives its beginning (the previous boundary's end).
    chosen = list(range(max(1, len(steps) - args.steps), len(steps)))
    busy_all = collections.defaultdict(float)
    idle_all = collections.defaultdict(float)
    launches_all = collections.Counter()
    walls, kernel_time, streams = [], [], set()
    for i in chosen:
        step_begin = steps[i - 1][-1][1]
        busy, idle, launches, wall = attribute(steps[i], step_begin, steps[i][-1][2] if args.main_stream else None)
        walls.append(wall)
        kernel_time.append(sum(end - start for start, end, _, _ in steps[i]) / 1e3)
        streams.update(k[2] for k in steps[i])
        for name in launches:
            busy_all[name] += busy[name] / len(chosen)
            idle_all[name] += idle[name] / len(chosen)
            launches_all[name] += launches[name] / len(chosen)
    wall = statistics.mean(walls)
    total_idle = sum(idle_all.values())
    print(f"{len(chosen)} steps: wall {wall:.1f} us (median {statistics.median(walls):.1f}), "
          f"{sum(launches_all.values()):.0f} kernels on {len(streams)} streams, kernel time {statistics.mean(kernel_time):.1f} us, "
          f"idle {total_idle:.1f} us ({100 * total_idle / wall:.1f} %)")
    print("   busy us   idle us  launches  kernel (the step's wall, split over its kernels)")
    names = sorted(launches_all, key=lambda n: -(busy_all[n] + idle_all[n]))
    for name in names[:args.top]:
        print(f"{busy_all[name]:10.1f}{idle_all[name]:10.1f}{launches_all[name]:10.2f}  {name}")
    if args.list:
        last = steps[chosen[-1]]
        begin = steps[chosen[-1] - 1][-1][1]
        print("  start us   dur us  stream  kernel (the last step, start order; durations include PDL waits)")
        for start, end, stream, name in last:
            print(f"{(start - begin) / 1e3:10.1f}{(end - start) / 1e3:9.1f}{stream:>8}  {name}")
    hidden = [n for n in names if busy_all[n] + idle_all[n] < 0.05]
    if hidden:
        print(f"hidden (charged nothing): {', '.join(hidden[:12])}{' …' if len(hidden) > 12 else ''}")


if __name__ == "__main__":
    main()
