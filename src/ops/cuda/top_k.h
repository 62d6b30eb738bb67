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

// No allocation and no host synchronisation (CUDA-graph safe). Four paths, chosen by the shape (top_k.cu):
// - a few long rows (≤ 4 rows of ≥ 64K columns): the grid path, two launches: every SM filters a span of the row
//   against a threshold all of them select from the same sample, then one CTA a row selects over the candidates
//   gathered in the workspace (exact: a fallback over the row when the estimate fails);
// - rows long enough to sample (one wave of thread-block clusters, each CTA's span over 8,192 keys): the sampled
//   path, one launch: a 1-in-16 sample of the row sets a threshold, one read of the row keeps the keys at or above
//   it, a radix select over those candidates (exact: a fallback over the row when the estimate fails);
// - else rows × CTAs-per-row ≤ the SMs: one launch, a cluster of up to 8 CTAs per row holds the row's scores in
//   shared memory as ordered keys and radix-selects over the cluster's combined histograms (11 + 11 + 10 bits);
// - else two launches, every 8K / 16K-column chunk selects its top-k in one CTA, then one CTA per row
//   selects among the chunks' candidates (top_k_chunked.cu).
cudaError_t top_k(const TopKParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
