// Sparse sink attention decode on the device (docs/kernels/attention.md): the CUDA twin of
// ops/cpu/sparse_attention.h, same parameters with device pointers.
//
// Heads share K=V (one 512-channel vector per key), so one CTA takes 64 heads of one token against tiles of 64
// keys: S = Q·Kᵀ and O += P·V on the bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation), an online softmax
// across tiles, the sink and the inverse RoPE in the epilogue. FP8 tiles are dequantized to bf16 in shared memory.
// When tokens × head groups do not fill the GPU the keys are split across CTAs (split-K) and a combine kernel
// merges the partial (max, sum, output) triples.
#pragma once
#include <cstddef>

#include <cuda_runtime.h>

#include "ops/cpu/sparse_attention.h"

namespace dsv4::ops::cuda {

// The key splits `sparse_attention` uses for these parameters on a GPU of `multiprocessors` SMs:
// p.num_splits if set, else enough to give every SM a CTA, at most one per 64-key tile.
int64_t sparse_attention_splits(const SparseAttentionParams& p, int multiprocessors);

// Scratch bytes the call needs (0 when it runs unsplit).
size_t sparse_attention_workspace_bytes(const SparseAttentionParams& p, int multiprocessors);

// q, out: device [tokens, heads, 512] bf16; workspace: device scratch of at least
// sparse_attention_workspace_bytes(p, multiprocessors of the current device) bytes.
cudaError_t sparse_attention(const SparseAttentionParams& p, const uint16_t* q, uint16_t* out, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
