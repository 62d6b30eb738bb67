"""The source lines (or SASS instructions) of one profiled kernel where its warps spent their stall samples, most
first: a short table from ncu's source page, for a kernel built with -lineinfo (cmake -DDSV4_CUDA_LINEINFO=ON).

    ncu --set full --import-source yes --kernel-name regex:NAME --launch-skip 5 --launch-count 1 -o rep BINARY ...
    ncu --import rep.ncu-rep --page source --csv --print-source cuda > source.csv      (or sass)
    python3 tools/reference/ncu_source_hotspots.py source.csv [top]

Columns are found by name (ncu versions differ): the sample count is the first column whose name starts with
"Warp Stall Sampling (All", the text the "Source" column.
"""
import argparse
import csv
import io


def read_rows(path):
    with open(path, newline="", errors="replace") as f:
        text = f.read()
    # ncu may print notices before the CSV; the header is the first line naming a Source column.
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if '"Source"' in line or line.startswith("Source,")), None)
    if first is None:
        raise SystemExit(f"no Source column in {path}")
    return list(csv.DictReader(io.StringIO("\n".join(lines[first:]))))


def number(text):
    try:
        return float(str(text).replace(",", "").strip() or 0)
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("top", nargs="?", type=int, default=30)
    args = parser.parse_args()
    rows = read_rows(args.csv)
    if not rows:
        raise SystemExit("no rows")
    header = list(rows[0].keys())
    samples_col = next((c for c in header if c and c.startswith("Warp Stall Sampling (All")), None)
    if samples_col is None:
        raise SystemExit(f"no stall-sampling column among {header}")
    not_issued_col = next((c for c in header if c and c.startswith("Warp Stall Sampling (Not")), None)
    line_col = next((c for c in header if c in ("#", "Line", "Address")), None)
    total = sum(number(r[samples_col]) for r in rows) or 1.0
    print(f"{len(rows)} rows, {total:.0f} stall samples")
    ranked = sorted(rows, key=lambda r: -number(r[samples_col]))
    for r in ranked[:args.top]:
        share = 100.0 * number(r[samples_col]) / total
        not_issued = f"{number(r[not_issued_col]):7.0f}" if not_issued_col else ""
        where = (r.get(line_col) or "").strip() if line_col else ""
        print(f"{share:5.1f} % {number(r[samples_col]):7.0f}{not_issued} {where:>6}  {(r.get('Source') or '').strip()[:110]}")


if __name__ == "__main__":
    main()
