// The dummy models' random tensors drawn on the device (--load-format dummy on the CUDA backend,
// model/cuda/device_random_weights.h): out[i] = element i of `fill` (core/random_fill.h), the value the host
// generator (model/random_init.h random_tensor) draws for the same element — up to the last ulp of glibc's and
// CUDA's double log / cos, which reaches the fp32 result about once in 10^8 elements. The host draws 17 M values/s
// per core (CPU machine): a V4-Flash layer's 6.6 billion values are ~24 s of 16 cores.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/random_fill.h"

namespace dsv4::ops::cuda {

// cudaErrorInvalidValue on a negative count.
cudaError_t fill_random(const RandomFill& fill, float* out, int64_t count, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
