// DSV4_HOST_DEVICE marks the small inline helpers (entry addressing, quantizer arithmetic) that the CPU twins and
// the CUDA kernels share, so both compile the same code.
#pragma once

#if defined(__CUDACC__)
#define DSV4_HOST_DEVICE __host__ __device__
#else
#define DSV4_HOST_DEVICE
#endif
