// Lightning-indexer scores on the device over the paged index-key cache: the CUDA twin of
// ops::cpu::indexer_scores_paged (ops/cpu/indexer_paged.h), same parameter struct, device pointers.
#pragma once
#include <cuda_runtime.h>

#include "ops/cpu/indexer_paged.h"

namespace dsv4::ops::cuda {

// One CTA scores 128-entry tiles of one query token: the 64 × 128 bf16 q of the token sits in shared memory,
// each warp streams 32 keys (FP8 dequantized to bf16 in registers, or bf16) and runs q · Kᵀ on the tensor cores
// (mma.sync m16n8k16, fp32 accumulation) with the key rows as M, then relu, the head weights and the head sum in
// registers. Needs heads 64, head_dim 128, entries_per_block a multiple of 32. Graph safe.
cudaError_t indexer_scores(const IndexerScoresParams& p, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
