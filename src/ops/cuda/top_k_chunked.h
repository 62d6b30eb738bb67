// The chunked top-k path (top_k_chunked.cu), for grids too large for one cluster per row in one wave: top_k()
// in top_k.h chooses it. Internal to ops/cuda.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "ops/cpu/indexer_paged.h"

namespace dsv4::ops::cuda {

size_t chunked_top_k_workspace_bytes(int64_t rows, int64_t columns, int64_t k);

// Two launches: every chunk of a row (8,192 columns for k ≤ 512, 16,384 above) selects its exact top-k by radix
// select in one CTA; one CTA per row selects the top-k among the chunks' candidates (the global top-k lies in
// the union of the chunks' top-k) and writes it in entry order. Parameters already validated by top_k().
cudaError_t chunked_top_k(const TopKParams& p, void* workspace, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
