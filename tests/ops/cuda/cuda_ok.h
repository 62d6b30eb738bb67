// DSV4_CUDA_OK(call): a CUDA runtime call that must succeed, else the file, line, call and CUDA's message go to
// stderr and the process aborts. For set-up code outside a gtest assertion (device problems, kbench cases).
#pragma once
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define DSV4_CUDA_OK(call)                                                                             \
  do {                                                                                                 \
    const cudaError_t status_ = (call);                                                                \
    if (status_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(status_)); \
      std::abort();                                                                                    \
    }                                                                                                  \
  } while (0)
