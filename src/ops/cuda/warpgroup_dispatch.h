// Which variant of a kernel family runs: the sm_90a warpgroup-MMA kernel where it exists, else the mma.sync
// one. Include only from dsv4_ops_cuda's own sources: DSV4_CUDA_SM90A is that target's private definition
// (src/ops/cuda/CMakeLists.txt: the library was built with sm_90a code).
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

namespace dsv4::ops::cuda {

// True where this build has sm_90a code and the current device is a Hopper (a multi-architecture build's
// other cubins hold an empty warpgroup kernel that traps). The environment switch `switch_name` = "mma"
// selects the mma.sync kernel anyway, to measure the two side by side; it is read on every call.
inline bool use_warpgroup_mma(const char* switch_name) {
#ifdef DSV4_CUDA_SM90A
  const char* value = std::getenv(switch_name);
  if (value != nullptr && std::strcmp(value, "mma") == 0) return false;
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         major == 9;
#else
  (void)switch_name;
  return false;
#endif
}

}  // namespace dsv4::ops::cuda
