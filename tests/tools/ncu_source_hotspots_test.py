"""tools/reference/ncu_source_hotspots.py on a synthetic ncu source-page export: notices before the CSV header are
skipped, rows are ranked by their stall samples, and each share is the row's samples over the kernel's total."""
import contextlib
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_tool import load  # noqa: E402

hotspots = load("ncu_source_hotspots")

EXPORT = '''==PROF== Connected to process 1234
"#","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"1","wait_for_prior_grid();","10","8","1,024"
"2","staged[i] = values[r];","5","1","2,048"
"3","s += staged[split * NV + lane];","1,085","900","4,096"
"4","return;","0","0","256"
'''


class NcuSourceHotspotsTest(unittest.TestCase):
    def run_main(self, text, top):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "source.csv")
            with open(path, "w") as f:
                f.write(text)
            sys.argv = ["ncu_source_hotspots.py", path, str(top)]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                hotspots.main()
        return printed.getvalue().splitlines()

    def test_ranks_lines_by_stall_samples(self):
        lines = self.run_main(EXPORT, 2)
        self.assertEqual(lines[0], "4 rows, 1100 stall samples")
        self.assertEqual(len(lines), 3)
        self.assertIn("s += staged[split * NV + lane];", lines[1])
        self.assertTrue(lines[1].lstrip().startswith("98.6 %"), lines[1])  # 1,085 of 1,100, thousands separators read
        self.assertIn("wait_for_prior_grid();", lines[2])

    def test_refuses_an_export_without_samples(self):
        with self.assertRaises(SystemExit):
            self.run_main('"#","Source","Instructions Executed"\n"1","x = 1;","3"\n', 5)


if __name__ == "__main__":
    unittest.main()
