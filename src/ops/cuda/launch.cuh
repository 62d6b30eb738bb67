// Programmatic dependent launch (PDL, Hopper): a kernel launched with launch_dependent() may be scheduled
// while the kernel before it in the stream is still draining, so its launch latency and prologue overlap that
// tail — the decode step is a chain of ~130 small dependent kernels, where that latency is a large share of
// the step (docs/PERF.md "Where a decode step goes"). CUDA graph capture keeps these programmatic edges.
//
// The contract: every kernel launched this way calls wait_for_prior_grid() before it reads anything an
// earlier kernel wrote (griddepcontrol.wait returns once the preceding grid has completed and its writes are
// visible; since that grid waited on its own predecessor before completing, completion is transitive along
// the stream), and calls allow_dependents() once it no longer needs to hold back the next kernel. A kernel
// launched normally ignores both instructions. DSV4_PDL=0 launches everything without the attribute (to
// measure the gain).
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace dsv4::ops::cuda {

__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

inline bool programmatic_launch_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("DSV4_PDL");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

// kernel<<<grid, block, shared, stream>>>(args...) with the programmatic-stream-serialization attribute.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
                             cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = programmatic_launch_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace dsv4::ops::cuda
