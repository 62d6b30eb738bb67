#include "ops/cuda/random_fill.h"

namespace dsv4::ops::cuda {
namespace {

// Consecutive elements per thread: the generator steps from one element to the next with an add instead of a
// jump (a multiply); the Box-Muller transform's double log and cos dominate either way.
constexpr int kElementsPerThread = 8;

__global__ void fill_random_kernel(RandomFill fill, float* out, int64_t count) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kElementsPerThread;
  if (first >= count) return;
  SplitMix64 generator = fill.generator_at(static_cast<uint64_t>(first));
  const int64_t last = first + kElementsPerThread < count ? first + kElementsPerThread : count;
  for (int64_t i = first; i < last; ++i) out[i] = fill.draw(generator);
}

}  // namespace

cudaError_t fill_random(const RandomFill& fill, float* out, int64_t count, cudaStream_t stream) {
  if (count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t threads = (count + kElementsPerThread - 1) / kElementsPerThread;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  fill_random_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(fill, out, count);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
