// kbench suite "fp8_gemm": DeepSeek's FP8 linear (ops/cuda/gemm.h linear_fp8, docs/kernels/fp8_gemm.md) at
// the V4-Flash dense shapes — wq_a 4096→1024, wq_b 1024→32768, wkv 4096→512, wo_b 8192→4096 — at 1 / 8 / 64 /
// 512 / 4096 rows: the bf16 product of the same shape (what the bf16 model runs: ops/cuda/skinny_gemm up to
// 16 rows, with cuBLASLt's beside it there, else cuBLASLt), the FP8
// product as kAuto picks it, each FP8 backend forced (cuBLASLt block-scaled; ops/cuda/fp8_gemm.h up to 64
// rows), and the activation quantizer alone (bf16 input). FP8 bytes = W (out·in) + W scales + x codes + x
// scales + y (fp32); bf16 bytes = W and x as bf16 + y. The FP8 rows' math ceiling is the H200 datasheet's
// dense FP8 rate (1979 TFLOP/s), the memory ceiling the copy bandwidth measured at start-up; the note gives
// the bf16 time over the FP8 time. The L2 is flushed before every timed call (kbench.h): weights come from
// HBM, as in serving.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "../../tests/ops/cuda/device_problem.h"
#include "core/error.h"
#include "kbench.h"
#include "ops/cuda/fp8_gemm.h"
#include "ops/cuda/fp8_quantize.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/skinny_gemm.h"

namespace dsv4::kbench {
namespace {

using ops::cuda::Fp8Backend;
using ops::cuda::GemmDtype;

__device__ uint32_t mix(size_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA6Bu;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

__global__ void fill_bf16(__nv_bfloat16* out, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = __float2bfloat16((static_cast<float>(mix(i, seed)) * 0x1p-31f - 1.0f) * scale);
}

// Random e4m3 codes, never NaN (0x7f / 0xff) and never zero.
__global__ void fill_e4m3(uint8_t* out, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t b = mix(i, seed) & 0xffu;
    if ((b & 0x7fu) == 0x7fu) b ^= 1u;
    if ((b & 0x7fu) == 0) b |= 0x38u;  // ±1
    out[i] = static_cast<uint8_t>(b);
  }
}

__global__ void fill_f32(float* out, size_t n, float value) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = value;
}

struct Shape {
  const char* name;
  int64_t in, out;
};
constexpr int64_t kMaxRows = 4096, kMaxIn = 8192,
                  kMaxWeight = 32768LL * 1024;  // 4096 x 8192 is the same count
constexpr int kChain = 8;                         // weight copies of the chained decode timing (512 MiB)

void keep_busy(const std::function<void()>& launch) {  // the GPU clocks down while the host sets a case up
  cudaEvent_t start, stop;
  DSV4_CUDA_OK(cudaEventCreate(&start));
  DSV4_CUDA_OK(cudaEventCreate(&stop));
  for (float busy_ms = 0; busy_ms < 20.0f;) {
    DSV4_CUDA_OK(cudaEventRecord(start));
    for (int i = 0; i < 10; ++i) launch();
    DSV4_CUDA_OK(cudaEventRecord(stop));
    DSV4_CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0;
    DSV4_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    busy_ms += ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

std::vector<CaseResult> run(const Ceilings& ceilings, const Options& options) {
  const std::vector<Shape> shapes = {
      {"wq_a", 4096, 1024}, {"wq_b", 1024, 32768}, {"wkv", 4096, 512}, {"wo_b", 8192, 4096}};
  const std::vector<int64_t> row_counts =
      options.quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 4, 8, 16, 64, 512, 4096};
  const int iterations = options.quick ? 5 : 20;
  uint8_t *w8 = nullptr, *codes = nullptr;
  __nv_bfloat16 *w16 = nullptr, *x16 = nullptr;
  float *w_scales = nullptr, *x_scales = nullptr, *y = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&w8, kMaxWeight));
  DSV4_CUDA_OK(cudaMalloc(&w16, kMaxWeight * 2));
  __nv_bfloat16* chain_w16 = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&chain_w16, kChain * kMaxWeight * 2));
  fill_bf16<<<4096, 256>>>(chain_w16, kChain * kMaxWeight, 6, 0.05f);
  DSV4_CUDA_OK(cudaMalloc(&w_scales, kMaxWeight / (128 * 128) * 4));
  DSV4_CUDA_OK(cudaMalloc(&x16, kMaxRows * kMaxIn * 2));
  DSV4_CUDA_OK(cudaMalloc(&codes, kMaxRows * kMaxIn));
  DSV4_CUDA_OK(cudaMalloc(&x_scales, kMaxRows * (kMaxIn / 128) * 4));
  DSV4_CUDA_OK(cudaMalloc(&y, kMaxRows * 32768 * 4));
  fill_e4m3<<<4096, 256>>>(w8, kMaxWeight, 3);
  fill_bf16<<<4096, 256>>>(w16, kMaxWeight, 4, 0.05f);
  fill_f32<<<64, 256>>>(w_scales, kMaxWeight / (128 * 128), 0x1p-8f);
  fill_bf16<<<4096, 256>>>(x16, kMaxRows * kMaxIn, 5, 2.0f);
  DSV4_CUDA_OK(cudaGetLastError());
  DSV4_CUDA_OK(cudaDeviceSynchronize());

  std::vector<CaseResult> results;
  ops::cuda::Gemm gemm;
  for (const Shape& s : shapes) {
    const ops::cuda::GemmWeight w8_desc{w8, GemmDtype::kF8E4M3, s.out, s.in, 0, w_scales};
    const ops::cuda::GemmWeight w16_desc{w16, GemmDtype::kBf16, s.out, s.in, 0};
    for (const int64_t rows : row_counts) {
      const std::string tag = std::string(s.name) + " " + std::to_string(s.in) + "->" +
                              std::to_string(s.out) + " r" + std::to_string(rows);
      // --case: the shape runs when any of its cases ("bf16 <tag>", "bf16 chain <tag>", "fp8 <tag>", …) is asked.
      if (!options.cases.empty() &&
          std::none_of(options.cases.begin(), options.cases.end(), [&](const std::string& c) {
            return c.size() >= tag.size() && c.compare(c.size() - tag.size(), tag.size(), tag) == 0;
          }))
        continue;
      const double flops = 2.0 * rows * s.out * s.in;
      const double scale_bytes =
          4.0 * ((s.out + 127) / 128) * ((s.in + 127) / 128) + 4.0 * rows * ((s.in + 127) / 128);
      const double fp8_bytes = double(s.out) * s.in + double(rows) * s.in + scale_bytes + 4.0 * rows * s.out;
      const double bf16_bytes = 2.0 * s.out * s.in + 2.0 * rows * s.in + 4.0 * rows * s.out;
      const double fp8_floor_us =
          1e6 * std::max(fp8_bytes / ceilings.copy_bytes_per_second, flops / kH200Fp8FlopsPerSecond);

      auto bf16_call = [&] { gemm.linear(w16_desc, x16, rows, y, nullptr); };
      keep_busy(bf16_call);
      const double bf16_us = time_kernel_us(bf16_call, iterations);
      const bool skinny = rows <= ops::cuda::kSkinnyMaxRows;
      results.push_back({"bf16 " + tag, bf16_us, flops, bf16_bytes,
                         skinny ? "the bf16 model's decode GEMM (gemm.cu: skinny_gemm or cuBLASLt)" : "cuBLASLt bf16 (the bf16 model's GEMM)"});
      if (skinny) {
        // Chained: kChain launches over kChain distinct weight copies in one timed call, as a decode step
        // runs its projections back to back (PDL edges, no host gap, no L2 reuse) — the single timed call
        // above also pays the event and ramp-up latency, which is most of the time of the small shapes.
        auto chained = [&] {
          for (int copy = 0; copy < kChain; ++copy) {
            const ops::cuda::GemmWeight chain_desc{chain_w16 + copy * kMaxWeight, GemmDtype::kBf16, s.out, s.in, 0};
            gemm.linear(chain_desc, x16, rows, y, nullptr);
          }
        };
        auto time_both = [&](const std::function<void()>& call, bool with_skinny) {
          gemm.set_bf16_skinny(with_skinny);
          keep_busy(call);
          const double us = time_kernel_us(call, iterations);
          gemm.set_bf16_skinny(true);
          return us;
        };
        // cuBLASLt's answer for the same shape beside it (what the bf16 model ran before).
        const double lt_us = time_both(bf16_call, false);
        const double chain_us = time_both(chained, true) / kChain;
        const double chain_lt_us = time_both(chained, false) / kChain;
        char note[120];
        std::snprintf(note, sizeof note, "cuBLASLt bf16; skinny is %.2fx faster", lt_us / bf16_us);
        results.push_back({"bf16 lt " + tag, lt_us, flops, bf16_bytes, note});
        results.push_back({"bf16 chain " + tag, chain_us, flops, bf16_bytes, "skinny_gemm, 8 launches back to back"});
        std::snprintf(note, sizeof note, "cuBLASLt, 8 back to back; skinny is %.2fx faster", chain_lt_us / chain_us);
        results.push_back({"bf16 chain lt " + tag, chain_lt_us, flops, bf16_bytes, note});
      }

      ops::cuda::Fp8QuantizeParams q;
      q.rows = rows;
      q.cols = s.in;
      q.bf16_input = true;
      auto quant_call = [&] {
        DSV4_CUDA_OK(ops::cuda::quantize_e4m3_rows(q, x16, codes, x_scales, nullptr));
      };
      quant_call();
      DSV4_CUDA_OK(cudaDeviceSynchronize());
      const ops::cuda::Fp8Activation act{codes, x_scales, 0};

      for (const Fp8Backend backend : {Fp8Backend::kAuto, Fp8Backend::kCublasLt, Fp8Backend::kSkinny}) {
        if (backend == Fp8Backend::kSkinny && rows > 64) continue;
        if (backend == Fp8Backend::kCublasLt && rows < 8) continue;  // refused below 8 rows (tests/ops/cuda)
        const char* name = backend == Fp8Backend::kAuto       ? "fp8 "
                           : backend == Fp8Backend::kCublasLt ? "fp8 lt "
                                                              : "fp8 sk ";
        gemm.set_fp8_backend(backend);
        auto call = [&] { gemm.linear_fp8(w8_desc, act, rows, y, nullptr); };
        try {
          call();
          DSV4_CUDA_OK(cudaDeviceSynchronize());
        } catch (const Error& e) {
          std::printf("  %s%s: refused (%s)\n", name, tag.c_str(), e.what());
          cudaGetLastError();
          continue;
        }
        keep_busy(call);
        const double us = time_kernel_us(call, iterations);
        char note[200];
        std::snprintf(note, sizeof note, "%s; bf16/fp8 %.2fx; roofline %.2f us",
                      gemm.fp8_uses_cublaslt(w8_desc, rows) ? "cuBLASLt blk128" : "fp8_gemm", bf16_us / us,
                      fp8_floor_us);
        CaseResult r{name + tag, us, flops, fp8_bytes, note};
        r.math_flops_per_second = kH200Fp8FlopsPerSecond;
        results.push_back(r);
      }
      gemm.set_fp8_backend(Fp8Backend::kAuto);
      if (rows <= 16) {  // the CUDA-core (FFMA) variant of fp8_gemm beside the tensor-core one
        ops::cuda::Fp8GemmParams fp;
        fp.rows = rows;
        fp.out = s.out;
        fp.in = s.in;
        fp.cuda_cores = true;
        auto call = [&] {
          DSV4_CUDA_OK(ops::cuda::fp8_skinny_gemm(fp, w8, w_scales, codes, x_scales, y, nullptr));
        };
        keep_busy(call);
        const double us = time_kernel_us(call, iterations);
        char note[200];
        std::snprintf(note, sizeof note, "fp8_gemm FFMA variant; bf16/fp8 %.2fx; roofline %.2f us",
                      bf16_us / us, fp8_floor_us);
        CaseResult r{"fp8 ffma " + tag, us, flops, fp8_bytes, note};
        r.math_flops_per_second = kH200Fp8FlopsPerSecond;
        results.push_back(r);
      }

      keep_busy(quant_call);
      const double quant_us = time_kernel_us(quant_call, iterations);
      results.push_back({"fp8 quantize " + std::string(s.name) + " r" + std::to_string(rows), quant_us, 0.0,
                         2.0 * rows * s.in + rows * s.in + 4.0 * rows * ((s.in + 127) / 128),
                         "bf16 x -> e4m3 + 1x128 scales"});
    }
  }
  for (void* p :
       {static_cast<void*>(w8), static_cast<void*>(codes), static_cast<void*>(w16), static_cast<void*>(chain_w16), static_cast<void*>(x16),
        static_cast<void*>(w_scales), static_cast<void*>(x_scales), static_cast<void*>(y)})
    cudaFree(p);
  return results;
}

const bool registered = register_suite("fp8_gemm", run);

}  // namespace
}  // namespace dsv4::kbench
