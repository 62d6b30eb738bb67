// Weight prefetch into the L2 cache while the decode step's latency-bound chains run.
//
// Why: a batch-1 decode step streams ≈ 3.3 GB of weights (the 4-layer V4-Flash cut) at ~2.8-3.0 TB/s, but between
// those streams sit chains of small dependent kernels — the mHC hand-over (hc_post → mixes → finish, ≈ 14 µs), the
// attention core (q norm + RoPE, attention, combine, ≈ 15 µs), the router — during which HBM is idle
// (docs/PERF.md "A decode step as it ran in the graph"). A kernel on a side stream, forked after one weight stream
// ends, can ask HBM for the first megabytes of the next one meanwhile; the next GEMM then finds them in L2
// (skinny_gemm's `ld.global.nc` and the expert kernel's cp.async both hit it) and its DRAM stream is shorter by
// those bytes. Nothing waits for the prefetch: it is a hint (`cp.async.bulk.prefetch.L2`, sm_90), so results
// are bitwise the same with or without it.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::ops::cuda {

struct L2PrefetchRange {
  const void* data = nullptr;  // device pointer, 16-byte aligned
  size_t bytes = 0;
};

inline constexpr int kL2PrefetchMaxRanges = 16;

struct L2PrefetchParams {
  L2PrefetchRange ranges[kL2PrefetchMaxRanges];
  int count = 0;
  // Adds [data, data + bytes) up to `budget` bytes still unspent; returns the bytes taken (0 once full or when
  // data is null). Ranges are prefetched in the order added: add them in the order the next kernels read them.
  size_t add(const void* data, size_t bytes, size_t& budget);
};

// Whether the kernel takes these ranges: count in [0, kL2PrefetchMaxRanges], each non-empty range 16-byte aligned
// with a size that is a multiple of 16 (add() rounds down to 16).
bool l2_prefetch_supported(const L2PrefetchParams& p);

// Issues the prefetches on `stream` and returns (the kernel ends as soon as its requests are issued). A device
// below sm_90 runs nothing (the instruction does not exist there). cudaErrorInvalidValue when unsupported.
cudaError_t prefetch_to_l2(const L2PrefetchParams& p, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
