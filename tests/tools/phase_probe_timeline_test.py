"""tools/reference/phase_probe_timeline.py on random probe lines mixed into other output: the SM clock estimate is
the generating clock, the per-probe medians are statistics.median of each mark in µs, and --grid keeps only the
lines of that grid."""
import contextlib
import io
import os
import random
import statistics
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_tool import load  # noqa: E402

timeline = load("phase_probe_timeline")


def random_log(rng, ghz):
    lines, truth = ["Prefill: 12.3 ms"], {}
    start = 10**12 + rng.randrange(10**6)
    for call in range(30):
        for name, grid in (("hc_mix", 1 + call % 2), ("hc_finish.head", 1 + call % 2)):
            marks = sorted(rng.uniform(100, 20000) for _ in range(rng.randint(2, 5)))
            cycles = [int(m) for m in marks]
            end = start + int(round(cycles[-1] / ghz))
            lines.append(f"phase_probe {name} call={call} grid={grid},128 block=256 start_ns={start} end_ns={end} "
                         f"cycles={''.join(' ' + str(c) for c in cycles)}")
            if grid == 1:
                truth.setdefault(name, []).append(cycles)
            start = end + rng.randrange(50, 5000)
        lines.append("some other output")
    return lines, truth


class PhaseProbeTimelineTest(unittest.TestCase):
    def run_main(self, lines, *extra):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "run.log")
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
            sys.argv = ["phase_probe_timeline.py", path, *extra]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                timeline.main()
        return printed.getvalue().splitlines()

    def test_clock_and_medians(self):
        rng = random.Random(7)
        ghz = rng.uniform(1.4, 2.0)
        lines, truth = random_log(rng, ghz)
        probes = timeline.parse(lines)
        self.assertEqual(len(probes), 60)
        self.assertAlmostEqual(timeline.clock_ghz(probes), ghz, delta=0.01)
        out = self.run_main(lines, "--grid", "1", "--clock-ghz", f"{ghz}")
        self.assertIn("(30 lines, grid.x = 1)", "\n".join(out))
        for name, rows in truth.items():
            row = next(line for line in out if line.strip().startswith(name))
            self.assertIn(f"n={len(rows)} ", row)
            marks = row.split("marks ")[1].split("  (")[0].split()
            for i, text in enumerate(marks):
                expect = statistics.median(r[i] / ghz / 1000 for r in rows if len(r) > i)
                self.assertAlmostEqual(float(text), expect, delta=0.006)

    def test_refuses_a_log_without_probes(self):
        with self.assertRaises(SystemExit):
            self.run_main(["Decode: 1.5 ms"])


if __name__ == "__main__":
    unittest.main()
