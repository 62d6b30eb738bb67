"""tools/reference/kernel_step_timeline.py against a naive formula: on random multi-stream traces, a step's busy
time must equal the measure of the union of its kernels' intervals (clipped to the step) and its idle time the rest
of the wall; and on hand-made steps, the share of each kernel must be the one worked out beside them."""
import csv
import os
import random
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_tool import load  # noqa: E402

timeline = load("kernel_step_timeline")


def write_trace(path, kernels):
    with open(path, "w", newline="") as f:
        f.write("Processing [report.sqlite] with [cuda_gpu_trace.py]...\n")  # nsys stats' notice before the CSV
        writer = csv.writer(f)
        writer.writerow(["Start (ns)", "Duration (ns)", "CorrId", "GrdX", "Strm", "Name"])
        for start, end, stream, name in kernels:
            writer.writerow([start, end - start, 0, 1, stream, name])
        writer.writerow([5, 1, 0, "", 7, "[CUDA memcpy Host-to-Device]"])  # a copy: no grid, skipped


def union_measure(intervals, lo, hi):
    total, cursor = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, cursor), min(end, hi)
        if end > start:
            total += end - start
            cursor = end
    return total


class NsysStepTimelineTest(unittest.TestCase):
    def test_hand_made_step(self):
        # Step 1 (after the boundary ending at 100): a 10-90 idle-free chain on stream 7, a side kernel on stream 9
        # that ends inside the chain (hidden), a gap of 20 before the boundary.
        kernels = [(0, 100, "7", "row_decide_kernel(args)"),
                   (110, 150, "7", "mix_partial_kernel<4, 4>(x)"),
                   (140, 200, "7", "finish_kernel<4>"),
                   (120, 180, "9", "side_kernel"),
                   (220, 230, "7", "row_decide_kernel(args)")]
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.csv")
            write_trace(path, kernels)
            steps = timeline.split_steps(timeline.read_kernels(path), r"row_decide", merge_within=0)
        self.assertEqual(len(steps), 1)
        busy, idle, launches, wall = timeline.attribute(steps[0], 100, "7")
        self.assertAlmostEqual(wall, 0.130)
        self.assertAlmostEqual(busy["mix_partial_kernel"], 0.040)
        self.assertAlmostEqual(idle["mix_partial_kernel"], 0.010)
        self.assertAlmostEqual(busy["finish_kernel"], 0.050)
        self.assertAlmostEqual(busy.get("side_kernel", 0.0), 0.0)  # ended at 180, inside finish_kernel's span
        self.assertAlmostEqual(idle["row_decide_kernel"], 0.020)
        self.assertAlmostEqual(busy["row_decide_kernel"], 0.010)
        self.assertEqual(launches["side_kernel"], 1)

    def test_sampling_launches_end_a_step_once(self):
        # A greedy step ends with chunk_argmax, chunk_pass, row_decide; a sampled one adds row_finish 2 launches on.
        names = (["row_decide_kernel"] + [f"a{i}" for i in range(5)] + ["row_decide_kernel", "chunk_weight_kernel",
                 "row_finish_kernel"] + [f"b{i}" for i in range(5)] + ["row_decide_kernel"])
        kernels = [(2 * i, 2 * i + 1, "7", name) for i, name in enumerate(names)]
        steps = timeline.split_steps(kernels, r"row_decide|row_finish")
        self.assertEqual([[k[3] for k in step] for step in steps],
                         [["a0", "a1", "a2", "a3", "a4", "row_decide_kernel", "chunk_weight_kernel", "row_finish_kernel"],
                          ["b0", "b1", "b2", "b3", "b4", "row_decide_kernel"]])

    def test_short_names(self):
        self.assertEqual(timeline.short_name(
            "void dsv4::ops::cuda::(anonymous namespace)::finish_kernel<4, false, 4, true>(const float *, int)"),
            "finish_kernel")
        self.assertEqual(timeline.short_name("void dsv4::ops::cuda::<unnamed>::skinny_gemm_kernel<false>(P)"),
                         "skinny_gemm_kernel")
        self.assertEqual(timeline.short_name("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"),
                         "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")

    def test_side_stream_charged_while_the_main_stream_waits(self):
        # Main stream 7: a (100-110), then b only at 145, after the side kernel s (105-140) it joins on.
        step = [(100, 110, "7", "a"), (105, 140, "9", "s"), (145, 160, "7", "b")]
        busy, idle, _, wall = timeline.attribute(step, 100, "7")
        self.assertAlmostEqual(wall, 0.060)
        self.assertAlmostEqual(busy["a"], 0.010)
        self.assertAlmostEqual(busy["s"], 0.030)  # 110-140: the main stream had nothing running
        self.assertAlmostEqual(idle["b"], 0.005)
        self.assertAlmostEqual(busy["b"], 0.015)

    def test_random_traces_match_the_union(self):
        rng = random.Random(12345)
        for trial in range(50):
            kernels, t = [(0, 10, "7", "row_decide_kernel")], 10
            for step in range(3):
                step_begin = t
                for i in range(rng.randint(1, 12)):
                    stream = rng.choice(["7", "9", "11"])
                    # A step's kernels start after the previous step's boundary (in stream order, or forked after it).
                    start = max(t + rng.randint(-30, 40), step_begin + 1)
                    kernels.append((start, start + rng.randint(1, 80), stream, f"k{rng.randint(0, 4)}"))
                    t = max(t, kernels[-1][1]) if stream == "7" else t
                boundary_start = max(end for _, end, _, _ in kernels) + rng.randint(0, 20)
                kernels.append((boundary_start, boundary_start + 5, "7", "row_decide_kernel"))
                t = boundary_start + 5
            with tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "trace.csv")
                write_trace(path, kernels)
                steps = timeline.split_steps(timeline.read_kernels(path), r"row_decide", merge_within=0)
            self.assertEqual(len(steps), 3, trial)
            for i, step in enumerate(steps):
                begin = steps[i - 1][-1][1] if i else 10
                busy, idle, _, wall = timeline.attribute(step, begin, "7")
                kernels_end = max(end for _, end, _, _ in step)
                self.assertAlmostEqual(wall, (kernels_end - begin) / 1e3, msg=trial)
                expected_busy = union_measure([(s, e) for s, e, _, _ in step], begin, kernels_end) / 1e3
                self.assertAlmostEqual(sum(busy.values()), expected_busy, msg=trial)
                self.assertAlmostEqual(sum(idle.values()), wall - expected_busy, msg=trial)


if __name__ == "__main__":
    sys.exit(unittest.main())
