"""torch.topk at the shapes of dsv4_kbench's top_k suite (bench/kbench/indexer_cases.cu), timed the same way:
CUDA events around one call, the L2 flushed before each, median of 30 after a warm-up. Scores are N(0, 1) fp32.

    python3 bench/kbench/torch_topk.py [--quick]
Prints one line per case: name (as kbench), torch.topk sorted=False us, sorted=True us.
"""
import sys

import torch


def time_us(fn, iterations, flush):
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(iterations):
        flush.fill_(i & 0xFF)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def main():
    quick = "--quick" in sys.argv
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    batches = [1, 64] if quick else [1, 4, 32, 64, 128]  # the batches of dsv4_kbench --suite top_k
    iterations = 5 if quick else 30
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"{'case':<28} {'unsorted us':>12} {'sorted us':>10}")
    for k in (512, 1024):
        for columns in (2048, 32768, 262144):
            for batch in batches:
                scores = torch.randn(batch, columns, device="cuda", dtype=torch.float32)
                unsorted = time_us(lambda: torch.topk(scores, k, dim=-1, sorted=False), iterations, flush)
                ordered = time_us(lambda: torch.topk(scores, k, dim=-1, sorted=True), iterations, flush)
                print(f"{f'top_k {k} {columns // 1024}K b{batch}':<28} {unsorted:12.2f} {ordered:10.2f}", flush=True)


if __name__ == "__main__":
    main()
