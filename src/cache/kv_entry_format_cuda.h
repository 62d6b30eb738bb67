// The CUDA writer / quantizer of main K=V entries: the device twin of write_kv_entries (cache/kv_entry_format.h),
// same parameters (device pointers), bit-identical output.
#pragma once
#include <cuda_runtime.h>

#include "cache/kv_entry_format.h"

namespace dsv4::cuda {

// kv: device [tokens, 512] bf16. One warp per vector: the 7 block maxima are warp reductions, each lane quantizes
// 14 no-rope channels and copies 2 rope channels.
cudaError_t write_kv_entries(const KvWriteParams& p, const uint16_t* kv, cudaStream_t stream);

}  // namespace dsv4::cuda
