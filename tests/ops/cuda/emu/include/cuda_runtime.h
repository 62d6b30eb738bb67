// Host emulation of the CUDA runtime subset used by ops/cuda/compressor.*, ops/cuda/hadamard_fp4.*,
// ops/cuda/fp8_quantize.* and their tests (run_compressor_emu.sh, run_hadamard_fp4_emu.sh, run_fp8_simulate_emu.sh).
#pragma once
#include <cstddef>
#include <cstdlib>
#include <cstring>
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
typedef void* cudaStream_t;
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "success" : "invalid value"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
template <typename T> inline cudaError_t cudaMalloc(T** p, size_t n) { *p = static_cast<T*>(std::malloc(n)); return cudaSuccess; }
inline cudaError_t cudaFree(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) { std::memcpy(d, s, n); return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaMemset(void* d, int value, size_t n) { std::memset(d, value, n); return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int* count) { *count = 1; return cudaSuccess; }
