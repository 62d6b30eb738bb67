// CUDA device-code emulation for run_compressor_emu.sh: a persistent pool of 256 threads runs each CTA, with real
// barriers and warp shuffles; CTAs run one after another.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#include <cuda_runtime.h>
#define __global__
#define __device__
#define __host__
#define __launch_bounds__(x)
#define __forceinline__ inline
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
extern thread_local Dim3 threadIdx;
extern Dim3 blockIdx, gridDim;
void __syncthreads();
double emu_shfl(double v, int src_lane_xor, int up, int mode);
template <typename T> T __shfl_xor_sync(unsigned, T v, int offset) { return static_cast<T>(emu_shfl(static_cast<double>(v), offset, 0, 0)); }
template <typename T> T __shfl_up_sync(unsigned, T v, int offset) { return static_cast<T>(emu_shfl(static_cast<double>(v), 0, offset, 1)); }
void emu_launch(int blocks, const std::function<void()>& body);
struct alignas(8) float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
struct __nv_bfloat16 { uint16_t bits; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  uint32_t w = __float_as_uint(v);
  w += 0x7fffu + ((w >> 16) & 1u);
  return {static_cast<uint16_t>(w >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(static_cast<uint32_t>(b.bits) << 16); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
typedef uint8_t __nv_fp8_storage_t;
enum { __NV_SATFINITE = 1, __NV_E4M3 = 2 };
#define __nv_cvt_float_to_fp8(v, sat, kind) ::dsv4::f32_to_e4m3_rne(v)
