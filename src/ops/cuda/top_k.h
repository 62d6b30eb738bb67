// Exact top-k of indexer scores on the device: the CUDA twin of ops::cpu::top_k (ops/cpu/indexer_paged.h), same
// parameter struct, device pointers. Same chosen set as the twin (equal scores to the lower entry), −inf/NaN
// never chosen, short rows give all their valid entries; indices come out in ascending entry order, −1 padded.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "ops/cpu/indexer_paged.h"

namespace dsv4::ops::cuda {

inline constexpr int64_t kTopKMaxColumns = 262144;
inline constexpr int64_t kTopKMaxK = 1024;

// Bytes of workspace top_k needs for `rows` rows of `columns` scores and this k.
size_t top_k_workspace_bytes(int64_t rows, int64_t columns, int64_t k);

// Two launches, no allocation and no host synchronisation (CUDA-graph safe): (1) every chunk of a row (8,192 columns
// for k ≤ 512, 16,384 above) selects its exact top-k by radix select in one CTA; (2) one CTA per row selects the top-k among the
// chunks' candidates (the global top-k is contained in the union of the chunks' top-k) and sorts it by entry.
cudaError_t top_k(const TopKParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
