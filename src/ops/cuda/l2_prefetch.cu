#include "ops/cuda/l2_prefetch.h"

#include <algorithm>

namespace dsv4::ops::cuda {
namespace {

// One thread a 16 KB chunk, one warp a CTA (512 KB): the chunks spread over many SMs, so many TMA units take the
// requests at once; one bulk prefetch instruction a chunk.
constexpr size_t kChunkBytes = 16 * 1024;
constexpr int kThreads = 32;

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(const L2PrefetchParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  size_t chunk = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (int r = 0; r < p.count; ++r) {
    const size_t chunks = (p.ranges[r].bytes + kChunkBytes - 1) / kChunkBytes;
    if (chunk >= chunks) {
      chunk -= chunks;
      continue;
    }
    const size_t offset = chunk * kChunkBytes;
    const size_t left = p.ranges[r].bytes - offset;
    const auto size = static_cast<uint32_t>(left < kChunkBytes ? left : kChunkBytes);
    const char* at = static_cast<const char*>(p.ranges[r].data) + offset;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(size) : "memory");
    return;
  }
#endif
}

}  // namespace

size_t L2PrefetchParams::add(const void* data, size_t bytes, size_t& budget) {
  if (data == nullptr || count >= kL2PrefetchMaxRanges) return 0;
  const size_t taken = std::min(bytes, budget) / 16 * 16;
  if (taken == 0) return 0;
  ranges[count++] = {data, taken};
  budget -= taken;
  return taken;
}

bool l2_prefetch_supported(const L2PrefetchParams& p) {
  if (p.count < 0 || p.count > kL2PrefetchMaxRanges) return false;
  for (int r = 0; r < p.count; ++r) {
    const L2PrefetchRange& range = p.ranges[r];
    if (range.bytes == 0) continue;
    if (range.data == nullptr || reinterpret_cast<uintptr_t>(range.data) % 16 != 0 || range.bytes % 16 != 0)
      return false;
  }
  return true;
}

cudaError_t prefetch_to_l2(const L2PrefetchParams& p, cudaStream_t stream) {
  if (!l2_prefetch_supported(p)) return cudaErrorInvalidValue;
  size_t chunks = 0;
  for (int r = 0; r < p.count; ++r) chunks += (p.ranges[r].bytes + kChunkBytes - 1) / kChunkBytes;
  if (chunks == 0) return cudaSuccess;
  const size_t blocks = (chunks + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;
  l2_prefetch_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
