// The CUDA writer of index keys into the paged pool (format: cache/index_key_format.h). Its CPU twin is
// write_index_keys_cpu, byte for byte.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cache/index_key_format.h"

namespace dsv4 {

// keys_bf16 [count, head_dim] (bf16 bits), slots [count] (block_id · entries_per_block + entry), pool: the arena's
// device base. One warp per key: amax by warp shuffles, one power-of-two scale, e4m3 with RNE (satfinite).
// head_dim must be 128. Graph safe: no allocation, no host sync.
cudaError_t write_index_keys_cuda(const IndexKeyPagedLayout& layout, const uint16_t* keys_bf16, const int64_t* slots,
                                  int64_t count, std::byte* pool, cudaStream_t stream);

}  // namespace dsv4
