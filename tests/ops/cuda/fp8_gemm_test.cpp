// DeepSeek's FP8 linear on the device (docs/kernels/fp8_gemm.md): the activation quantizer (ops/cuda/
// fp8_quantize.h) bit for bit against its CPU twin ops::cpu::quantize_e4m3_blocks, and Gemm::linear_fp8 /
// linear_fp8_quantize (cuBLASLt block-scaled or ops/cuda/fp8_gemm.h) against the CPU recipe of
// model/deepseek_v4.cpp's project_fp8 (quantized x, dequantized W, per-128-block double sums rounded to fp32
// and added in fp32: ops::cpu::linear_f64 with k_block 128) and against a plain double product. V4-Flash
// shapes (wq_a, wq_b, wkv, wo_b) at 1 / 7 / 64 / 300 / 4096 rows, odd shapes, both backends forced, bf16
// output, bitwise repeats. Random inputs only (never zeros); outputs poisoned before each call. Each case
// prints its errors (the device log keeps them: docs/PERF.md).
#include "ops/cuda/fp8_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/quantize.h"
#include "ops/cuda/fp8_quantize.h"
#include "fp8_test_inputs.h"
#include "ops/cuda/gemm.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::DeviceArray;
using testing::fp8_edge_values;
using testing::random_activations;
using testing::same_bits;

class CudaFp8 : public testing::small_ops::GpuTest {};

int64_t blocks(int64_t n) { return (n + 127) / 128; }


// A checkpoint-like FP8 weight: fp32 normal values quantized per 128 × 128 block with a UE8M0 scale (amax /
// 448 rounded up to a power of two), as DeepSeek's release stores them.
struct Fp8Weight {
  int64_t out = 0, in = 0;
  std::vector<uint8_t> codes;  // [out, in]
  std::vector<float> scales;   // [ceil(out/128), ceil(in/128)]
  std::vector<float> dequant;  // [out, in] code · scale

  Fp8Weight(int64_t out_, int64_t in_, uint32_t seed) : out(out_), in(in_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<float> w(static_cast<size_t>(out * in));
    for (auto& v : w) v = normal(rng);
    scales.assign(static_cast<size_t>(blocks(out) * blocks(in)), 0.0f);
    for (int64_t bo = 0; bo < blocks(out); ++bo)
      for (int64_t bi = 0; bi < blocks(in); ++bi) {
        float amax = 0;
        for (int64_t o = bo * 128; o < std::min(out, bo * 128 + 128); ++o)
          for (int64_t i = bi * 128; i < std::min(in, bi * 128 + 128); ++i)
            amax = std::max(amax, std::fabs(w[o * in + i]));
        scales[bo * blocks(in) + bi] = cpu::ue8m0_scale(amax, cpu::kE4m3Max, 1e-4f);
      }
    codes.resize(w.size());
    dequant.resize(w.size());
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        const float s = scales[(o / 128) * blocks(in) + i / 128];
        const float q = cpu::e4m3_round(std::clamp(w[o * in + i] / s, -448.0f, 448.0f));
        codes[o * in + i] = f32_to_e4m3(q);
        dequant[o * in + i] = f8e4m3_to_f32(codes[o * in + i]) * s;
      }
  }
  // The e4m3 byte of a value already on the e4m3 grid (checked by decoding it back).
  static uint8_t f32_to_e4m3(float v) {
    const float m = std::fabs(v);
    uint32_t code = 0;
    if (m >= std::ldexp(1.0f, -6)) {
      const int e = std::ilogb(m);
      code = static_cast<uint32_t>((e + 7) << 3) | static_cast<uint32_t>(std::ldexp(m, -e) * 8.0f - 8.0f);
    } else {
      code = static_cast<uint32_t>(std::ldexp(m, 9));
    }
    if (std::signbit(v)) code |= 0x80u;
    if (!same_bits(f8e4m3_to_f32(static_cast<uint8_t>(code)), v)) ADD_FAILURE() << "not an e4m3 value: " << v;
    return static_cast<uint8_t>(code);
  }
};

struct Errors {
  double vs_recipe = 0, vs_double = 0, max_rel_recipe = 0;
};

// The reference on a sample of rows (all when rows <= 64; 32 spread over the rest): project_fp8's recipe (CPU
// quantizer, dequantized W, linear_f64 with k_block 128 — the fp32 result before its bf16 rounding) and the
// double product of the same operands rounded once to fp32 (linear_f64 with one block).
struct Reference {
  std::vector<int64_t> sample;
  std::vector<float> recipe, exact;  // [sample, out]
};

Reference make_reference(const Fp8Weight& w, const std::vector<float>& x, int64_t rows) {
  Reference ref;
  if (rows <= 64) {
    for (int64_t r = 0; r < rows; ++r) ref.sample.push_back(r);
  } else {
    for (int64_t i = 0; i < 32; ++i) ref.sample.push_back(i * (rows - 1) / 31);
  }
  const int64_t n = static_cast<int64_t>(ref.sample.size());
  std::vector<float> xq(static_cast<size_t>(n * w.in));
  for (int64_t i = 0; i < n; ++i) {
    std::copy(x.begin() + ref.sample[i] * w.in, x.begin() + (ref.sample[i] + 1) * w.in,
              xq.begin() + i * w.in);
    cpu::quantize_e4m3_blocks(&xq[i * w.in], w.in, 128);
  }
  ref.recipe.resize(static_cast<size_t>(n * w.out));
  ref.exact.resize(ref.recipe.size());
  cpu::linear_f64(xq.data(), n, w.in, w.dequant.data(), w.out, ref.recipe.data(), 128);
  cpu::linear_f64(xq.data(), n, w.in, w.dequant.data(), w.out, ref.exact.data(), 0);
  return ref;
}

Errors compare(const Reference& ref, int64_t out, const std::vector<float>& y, int64_t y_stride,
               bool bf16_output) {
  double num_r = 0, num_d = 0, den = 0, max_rel = 0;
  for (size_t i = 0; i < ref.sample.size(); ++i)
    for (int64_t o = 0; o < out; ++o) {
      const double exact = ref.exact[i * out + o];
      float expected = ref.recipe[i * out + o];
      if (bf16_output) expected = bf16_to_f32(f32_to_bf16(expected));
      const double actual = y[ref.sample[i] * y_stride + o];
      num_r += (actual - expected) * (actual - expected);
      num_d += (actual - exact) * (actual - exact);
      den += exact * exact;
      max_rel = std::max(max_rel, std::fabs(actual - expected) / (std::fabs(expected) + 1e-30));
    }
  return {std::sqrt(num_r / den), std::sqrt(num_d / den), max_rel};
}

std::string backend_name(Fp8Backend b) {
  return b == Fp8Backend::kAuto ? "auto" : b == Fp8Backend::kCublasLt ? "cublaslt" : "skinny";
}

// One product through linear_fp8_quantize (fp32 input) with the given backend; false when a forced cuBLASLt
// refused the shape (printed, not a failure: kAuto never asks it for such shapes).
// Bounds: ops/cuda/fp8_gemm.h sums in true fp32 (measured ~1e-7); cuBLASLt's block-scaled kernels run the
// Hopper FP8 mma, whose accumulation keeps fewer bits than fp32 (measured 1.6e-4 .. 2.6e-4 on these data; the
// tilelang kernel of the reference runs the same instructions), so they get kCublasLtBound.
constexpr double kFp8GemmBound = 1e-5, kCublasLtBound = 5e-4;

bool run_case(Gemm& gemm, Fp8Backend backend, const Fp8Weight& w, const DeviceArray<uint8_t>& dw,
              const DeviceArray<float>& dws, const Reference& ref, const DeviceArray<float>& dx, int64_t rows,
              double fp8_gemm_bound) {
  DeviceArray<float> dy(static_cast<size_t>(rows * w.out));
  gemm.set_fp8_backend(backend);
  const GemmWeight gw{dw.get(), GemmDtype::kF8E4M3, w.out, w.in, 0, dws.get()};
  try {
    gemm.linear_fp8_quantize(gw, dx.get(), GemmDtype::kF32, rows, dy.get(), nullptr);
  } catch (const Error& e) {
    EXPECT_EQ(backend, Fp8Backend::kCublasLt) << e.what();
    std::printf("[fp8] in %5ld out %5ld rows %4ld %-8s refused: %s\n", static_cast<long>(w.in),
                static_cast<long>(w.out), static_cast<long>(rows), backend_name(backend).c_str(), e.what());
    return false;
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const bool lt = gemm.fp8_uses_cublaslt(gw, rows, GemmDtype::kF32, (w.in + 15) / 16 * 16);
  const Errors e = compare(ref, w.out, dy.download(), w.out, false);
  std::printf(
      "[fp8] in %5ld out %5ld rows %4ld %-8s (%s) rel_l2 vs recipe %.3e vs double %.3e max rel %.3e\n",
      static_cast<long>(w.in), static_cast<long>(w.out), static_cast<long>(rows),
      backend_name(backend).c_str(), lt ? "cuBLASLt" : "fp8_gemm", e.vs_recipe, e.vs_double,
      e.max_rel_recipe);
  const double bound = lt ? kCublasLtBound : fp8_gemm_bound;
  EXPECT_LE(e.vs_recipe, bound) << backend_name(backend) << " rows " << rows;
  EXPECT_LE(e.vs_double, bound) << backend_name(backend) << " rows " << rows;
  gemm.set_fp8_backend(Fp8Backend::kAuto);
  return true;
}

// ---- quantizer ----

void check_quantizer(const std::vector<float>& x, int64_t rows, int64_t cols, bool bf16_input,
                     int64_t x_stride, int64_t code_stride, int64_t scale_stride) {
  SCOPED_TRACE(::testing::Message() << "rows " << rows << " cols " << cols << (bf16_input ? " bf16" : " fp32")
                                    << " strides " << x_stride << "/" << code_stride << "/" << scale_stride);
  // The value the CPU sees: the bf16-rounded input for a bf16 tensor.
  std::vector<float> host(static_cast<size_t>(rows * x_stride), 1.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = x[r * cols + c];
      host[r * x_stride + c] = bf16_input ? bf16_to_f32(f32_to_bf16(v)) : v;
    }
  std::vector<uint16_t> host16(host.size());
  for (size_t i = 0; i < host.size(); ++i) host16[i] = f32_to_bf16(host[i]);
  DeviceArray<float> dx32(host);
  DeviceArray<uint16_t> dx16(host16);
  DeviceArray<uint8_t> codes(static_cast<size_t>(rows * code_stride));
  DeviceArray<float> scales(static_cast<size_t>(blocks(cols) * scale_stride));
  Fp8QuantizeParams p;
  p.rows = rows;
  p.cols = cols;
  p.x_stride = x_stride;
  p.code_stride = code_stride;
  p.scale_stride = scale_stride;
  p.bf16_input = bf16_input;
  const void* xp = bf16_input ? static_cast<const void*>(dx16.get()) : dx32.get();
  ASSERT_EQ(quantize_e4m3_rows(p, xp, codes.get(), scales.get(), nullptr), cudaSuccess);
  const std::vector<uint8_t> q = codes.download();
  const std::vector<float> s = scales.download();
  int64_t mismatches = 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> expected(host.begin() + r * x_stride, host.begin() + r * x_stride + cols);
    cpu::quantize_e4m3_blocks(expected.data(), cols, 128);
    for (int64_t b = 0; b < blocks(cols); ++b) {
      float amax = 0;
      for (int64_t c = b * 128; c < std::min(cols, b * 128 + 128); ++c)
        amax = std::max(amax, std::fabs(host[r * x_stride + c]));
      const float scale = cpu::ue8m0_scale(amax, cpu::kE4m3Max, 1e-4f);
      const float got_scale = s[b * scale_stride + r];
      if (!same_bits(got_scale, scale) && mismatches++ < 5)
        ADD_FAILURE() << "scale row " << r << " block " << b << ": " << got_scale << " vs " << scale;
      for (int64_t c = b * 128; c < std::min(cols, b * 128 + 128); ++c) {
        const float got = f8e4m3_to_f32(q[r * code_stride + c]) * got_scale;
        if (!same_bits(got, expected[c]) && mismatches++ < 5)
          ADD_FAILURE() << "row " << r << " col " << c << ": " << got << " (code "
                        << int(q[r * code_stride + c]) << ") vs " << expected[c] << " from "
                        << host[r * x_stride + c];
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_F(CudaFp8, QuantizerIsBitExactWithTheCpuTwin) {
  for (const bool bf16 : {false, true})
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 4096}, {7, 4096}, {300, 1024}, {64, 8192}, {5, 200}, {3, 129}, {9, 7}, {33, 336}}) {
      const auto x = random_activations(rows, cols, static_cast<uint32_t>(rows * 131 + cols));
      check_quantizer(x, rows, cols, bf16, cols, cols, rows);
    }
}

TEST_F(CudaFp8, QuantizerPaddedStridesAndScalarPath) {
  const int64_t rows = 13, cols = 300;
  const auto x = random_activations(rows, cols, 77);
  check_quantizer(x, rows, cols, false, cols + 4, cols + 20, rows + 3);  // vector path, padded
  check_quantizer(x, rows, cols, false, cols + 1, cols + 3, rows);       // odd strides: scalar path
  check_quantizer(x, rows, cols, true, cols + 2, cols + 1, rows);
}

TEST_F(CudaFp8, QuantizerEdgeValues) {
  const int64_t rows = 6, cols = 256;
  const std::vector<float> x = fp8_edge_values(cols, 128);
  check_quantizer(x, rows, cols, false, cols, cols, rows);
  check_quantizer(x, rows, cols, true, cols, cols, rows);
}

// ---- GEMM ----

struct Shape {
  const char* name;
  int64_t in, out;
};
// The V4-Flash dense FP8 linears (model_spec.md §2): wq_a, wq_b, wkv, wo_b.
const std::vector<Shape> kFlashShapes = {
    {"wq_a", 4096, 1024}, {"wq_b", 1024, 32768}, {"wkv", 4096, 512}, {"wo_b", 8192, 4096}};

// Each shape at each row count through kAuto, the skinny kernel (up to `skinny_max_rows`) and a forced cuBLASLt,
// against the CPU recipe; the weight seeded by in · in_seed + out, the input by rows · row_seed + out.
void expect_shapes_match_recipe(const std::vector<Shape>& shapes, std::initializer_list<int64_t> row_counts,
                                int64_t skinny_max_rows, uint32_t in_seed, uint32_t row_seed) {
  Gemm gemm;
  for (const Shape& shape : shapes) {
    const Fp8Weight w(shape.out, shape.in, static_cast<uint32_t>(shape.in * in_seed + shape.out));
    DeviceArray<uint8_t> dw(w.codes);
    DeviceArray<float> dws(w.scales);
    for (const int64_t rows : row_counts) {
      SCOPED_TRACE(::testing::Message() << shape.name << " rows " << rows);
      const auto x = random_activations(rows, shape.in, static_cast<uint32_t>(rows * row_seed + shape.out));
      DeviceArray<float> dx(x);
      const Reference ref = make_reference(w, x, rows);
      run_case(gemm, Fp8Backend::kAuto, w, dw, dws, ref, dx, rows, 1e-5);
      if (rows <= skinny_max_rows) run_case(gemm, Fp8Backend::kSkinny, w, dw, dws, ref, dx, rows, 1e-5);
      run_case(gemm, Fp8Backend::kCublasLt, w, dw, dws, ref, dx, rows, 1e-5);
    }
  }
}

TEST_F(CudaFp8, FlashShapesMatchTheCpuRecipe) {
  expect_shapes_match_recipe(kFlashShapes, {1, 7, 64, 300, 4096}, 300, 1, 7);
}

// The FP8 linears of the V4-shaped test model (tests/model/test_models.h v4_shaped_config: hidden 512, q_lora 256,
// 64 × 512 heads, o_lora 8 × 128, an indexer of 64 × 128, moe_intermediate 256), at the row counts its scripts
// give (a 128-token chunk beside a 40-token one, decode rows): the model gave NaN logits there with cuBLASLt and
// finite ones with the skinny kernel (session 27). cuBLASLt reads its BLK128x128 weight scales with a multiple of
// 4 K-blocks a row; K = 256 has 2, so a forced cuBLASLt refuses it and kAuto takes the skinny kernel.
TEST_F(CudaFp8, V4ShapedTestModelShapesMatchTheCpuRecipe) {
  const std::vector<Shape> shapes = {{"wq_a", 512, 256},      {"wq_b", 256, 32768},        {"wkv", 512, 512},
                                     {"wo_b", 1024, 512},     {"indexer_wq_b", 256, 8192}, {"shared_w13", 512, 512},
                                     {"shared_w2", 256, 512}};
  expect_shapes_match_recipe(shapes, {2, 40, 128, 168, 300}, 300, 3, 5);
}

TEST_F(CudaFp8, CublasLtScaleLayouts) {
  // Random codes and random power-of-two scales per block (2^-4..2^4), so that a misread scale layout shows:
  // the cuBLASLt product against four readings of the two scale tensors — weight scales [out/128][in/128]
  // (ours, the checkpoint's) or transposed, activation scales [in/128][rows] (ours) or [rows][in/128]. Ours
  // must match.
  const int64_t rows = 64, in = 512, out = 384, kb = in / 128, ob = out / 128;
  std::mt19937 rng(4);
  std::vector<uint8_t> wc(static_cast<size_t>(out * in)), xc(static_cast<size_t>(rows * in));
  for (auto* v : {&wc, &xc})
    for (auto& c : *v) {
      c = static_cast<uint8_t>(rng() & 0xff);
      if ((c & 0x7f) == 0x7f) c ^= 1;
    }
  std::vector<float> ws(static_cast<size_t>(ob * kb)), xs(static_cast<size_t>(kb * rows));
  for (auto* v : {&ws, &xs})
    for (auto& s : *v) s = std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4);
  DeviceArray<uint8_t> dwc(wc), dxc(xc);
  DeviceArray<float> dws(ws), dxs(xs), dy(static_cast<size_t>(rows * out));
  Gemm gemm;
  gemm.set_fp8_backend(Fp8Backend::kCublasLt);
  try {
    gemm.linear_fp8({dwc.get(), GemmDtype::kF8E4M3, out, in, 0, dws.get()}, {dxc.get(), dxs.get(), 0}, rows,
                    dy.get(), nullptr);
  } catch (const Error& e) {
    GTEST_SKIP() << "cuBLASLt refused: " << e.what();
  }
  const std::vector<float> y = dy.download();
  for (int reading = 0; reading < 4; ++reading) {
    const bool w_transposed = reading & 1, x_row_major = reading & 2;
    double num = 0, den = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double sum = 0;
        for (int64_t b = 0; b < kb; ++b) {
          double block = 0;
          for (int64_t k = b * 128; k < b * 128 + 128; ++k)
            block += static_cast<double>(f8e4m3_to_f32(wc[o * in + k])) * f8e4m3_to_f32(xc[r * in + k]);
          const double sw = w_transposed ? ws[b * ob + o / 128 % ob] : ws[(o / 128) * kb + b];
          const double sx = x_row_major ? xs[r * kb + b] : xs[b * rows + r];
          sum += block * sw * sx;
        }
        num += (y[r * out + o] - sum) * (y[r * out + o] - sum);
        den += sum * sum;
      }
    const double rel = std::sqrt(num / den);
    std::printf("[fp8] cuBLASLt scale reading: weight scales %s, activation scales %s: rel_l2 %.3e\n",
                w_transposed ? "[in/128][out/128]" : "[out/128][in/128]",
                x_row_major ? "[rows][in/128]" : "[in/128][rows]", rel);
    if (reading == 0) {
      EXPECT_LE(rel, kCublasLtBound) << "our layouts";
    } else {
      EXPECT_GT(rel, 1e-2) << "another reading also fits: the probe cannot tell";
    }
  }
}

TEST_F(CudaFp8, OddShapesMatchTheCpuRecipe) {
  // Not multiples of 128 (the tiny test configs): kAuto takes ops/cuda/fp8_gemm.h; forced cuBLASLt is only
  // reported (it may refuse, or need whole blocks).
  Gemm gemm;
  for (const auto& [in, out, rows] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{200, 72, 5},
                                                                                        {336, 130, 33},
                                                                                        {129, 257, 3},
                                                                                        {96, 40, 20},
                                                                                        {1000, 384, 17},
                                                                                        {128, 128, 1},
                                                                                        {64, 300, 9},
                                                                                        {7, 5, 2}}) {
    SCOPED_TRACE(::testing::Message() << "in " << in << " out " << out << " rows " << rows);
    const Fp8Weight w(out, in, static_cast<uint32_t>(in * 3 + out));
    DeviceArray<uint8_t> dw(w.codes);
    DeviceArray<float> dws(w.scales);
    const auto x = random_activations(rows, in, static_cast<uint32_t>(rows + in));
    DeviceArray<float> dx(x);
    const Reference ref = make_reference(w, x, rows);
    run_case(gemm, Fp8Backend::kAuto, w, dw, dws, ref, dx, rows, 1e-5);
    const bool lt = gemm.fp8_uses_cublaslt({dw.get(), GemmDtype::kF8E4M3, out, in, 0, dws.get()}, rows,
                                           GemmDtype::kF32, (in + 15) / 16 * 16);
    EXPECT_FALSE(lt) << "kAuto sends partial 128-blocks to the CUDA-core kernel";
    gemm.set_fp8_backend(Fp8Backend::kCublasLt);
    if (in % 16 == 0) {
      DeviceArray<float> dy(static_cast<size_t>(rows * out));
      try {
        gemm.linear_fp8_quantize({dw.get(), GemmDtype::kF8E4M3, out, in, 0, dws.get()}, dx.get(),
                                 GemmDtype::kF32, rows, dy.get(), nullptr);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const Errors e = compare(ref, out, dy.download(), out, false);
        std::printf(
            "[fp8] odd in %ld out %ld rows %ld forced cuBLASLt: rel_l2 vs recipe %.3e (informational)\n",
            static_cast<long>(in), static_cast<long>(out), static_cast<long>(rows), e.vs_recipe);
      } catch (const Error& e) {
        std::printf("[fp8] odd in %ld out %ld rows %ld forced cuBLASLt refused: %s\n", static_cast<long>(in),
                    static_cast<long>(out), static_cast<long>(rows), e.what());
      }
      cudaGetLastError();
    }
    gemm.set_fp8_backend(Fp8Backend::kAuto);
  }
}

TEST_F(CudaFp8, PaddedStridesAndBf16Output) {
  // linear_fp8 on codes the caller quantized into a padded buffer, y with a padded row stride, fp32 and bf16
  // y, both backends.
  const int64_t in = 1024, out = 512, code_stride = in + 32, y_stride = out + 8;
  const Fp8Weight w(out, in, 5);
  DeviceArray<uint8_t> dw(w.codes);
  DeviceArray<float> dws(w.scales);
  for (const int64_t rows : {3, 96}) {
    const auto x = random_activations(rows, in, static_cast<uint32_t>(rows));
    DeviceArray<float> dx(x);
    const Reference ref = make_reference(w, x, rows);
    DeviceArray<uint8_t> codes(static_cast<size_t>(rows * code_stride));
    DeviceArray<float> scales(static_cast<size_t>(blocks(in) * rows));
    Fp8QuantizeParams q;
    q.rows = rows;
    q.cols = in;
    q.code_stride = code_stride;
    ASSERT_EQ(quantize_e4m3_rows(q, dx.get(), codes.get(), scales.get(), nullptr), cudaSuccess);
    for (const Fp8Backend backend : {Fp8Backend::kSkinny, Fp8Backend::kCublasLt})
      for (const bool bf16 : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "rows " << rows << " " << backend_name(backend) << (bf16 ? " bf16" : ""));
        Gemm gemm;
        gemm.set_fp8_backend(backend);
        DeviceArray<float> dy32(static_cast<size_t>(rows * y_stride));
        DeviceArray<uint16_t> dy16(static_cast<size_t>(rows * y_stride));
        void* y = bf16 ? static_cast<void*>(dy16.get()) : static_cast<void*>(dy32.get());
        try {
          gemm.linear_fp8({dw.get(), GemmDtype::kF8E4M3, out, in, 0, dws.get()},
                          {codes.get(), scales.get(), code_stride}, rows, y, nullptr,
                          bf16 ? GemmDtype::kBf16 : GemmDtype::kF32, y_stride);
        } catch (const Error& e) {
          ASSERT_EQ(backend, Fp8Backend::kCublasLt) << e.what();
          std::printf("[fp8] padded rows %ld cuBLASLt refused: %s\n", static_cast<long>(rows), e.what());
          continue;
        }
        std::vector<float> actual(static_cast<size_t>(rows * y_stride));
        if (bf16) {
          const auto bits = dy16.download();
          for (size_t i = 0; i < bits.size(); ++i) actual[i] = bf16_to_f32(bits[i]);
        } else {
          actual = dy32.download();
        }
        // Padding columns keep their poison (0xff bytes: NaN).
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t o = out; o < y_stride; ++o) EXPECT_TRUE(std::isnan(actual[r * y_stride + o]));
        const Errors e = compare(ref, out, actual, y_stride, bf16);
        std::printf("[fp8] padded rows %ld %s %s: rel_l2 vs recipe %.3e\n", static_cast<long>(rows),
                    backend_name(backend).c_str(), bf16 ? "bf16" : "fp32", e.vs_recipe);
        // bf16 y: the recipe's fp32 value rounded to bf16; a last-bit fp32 difference can flip a rounding.
        const bool lt = backend == Fp8Backend::kCublasLt;
        EXPECT_LE(e.vs_recipe, bf16 ? (lt ? 2e-3 : 1e-3) : (lt ? kCublasLtBound : kFp8GemmBound));
      }
  }
}

TEST_F(CudaFp8, TensorCoreAndCudaCoreKernelsMatchTheRecipe) {
  // ops/cuda/fp8_gemm.h's two kernels (the f16 mma one where in is a multiple of 128, the FFMA one otherwise
  // or when asked) on the same operands, 1..13 rows (13: two chunks of 8), fp32 and bf16 y.
  for (const Shape& shape :
       {Shape{"wq_a", 4096, 1024}, Shape{"wq_b", 1024, 32768}, Shape{"small", 128, 48}}) {
    const Fp8Weight w(shape.out, shape.in, static_cast<uint32_t>(shape.out));
    DeviceArray<uint8_t> dw(w.codes);
    DeviceArray<float> dws(w.scales);
    for (const int64_t rows : {1, 2, 5, 8, 13}) {
      const auto x = random_activations(rows, shape.in, static_cast<uint32_t>(rows * 3));
      DeviceArray<float> dx(x);
      const Reference ref = make_reference(w, x, rows);
      DeviceArray<uint8_t> codes(static_cast<size_t>(rows * shape.in));
      DeviceArray<float> scales(static_cast<size_t>(blocks(shape.in) * rows));
      Fp8QuantizeParams q;
      q.rows = rows;
      q.cols = shape.in;
      ASSERT_EQ(quantize_e4m3_rows(q, dx.get(), codes.get(), scales.get(), nullptr), cudaSuccess);
      for (const bool cuda_cores : {false, true}) {
        DeviceArray<float> dy(static_cast<size_t>(rows * shape.out));
        Fp8GemmParams p;
        p.rows = rows;
        p.out = shape.out;
        p.in = shape.in;
        p.cuda_cores = cuda_cores;
        ASSERT_EQ(fp8_skinny_gemm(p, dw.get(), dws.get(), codes.get(), scales.get(), dy.get(), nullptr),
                  cudaSuccess);
        const Errors e = compare(ref, shape.out, dy.download(), shape.out, false);
        std::printf("[fp8] kernel %s %s rows %ld: rel_l2 vs recipe %.3e vs double %.3e\n",
                    cuda_cores ? "ffma" : "mma ", shape.name, static_cast<long>(rows), e.vs_recipe,
                    e.vs_double);
        EXPECT_LE(e.vs_recipe, kFp8GemmBound)
            << shape.name << " rows " << rows << (cuda_cores ? " ffma" : " mma");
        EXPECT_LE(e.vs_double, kFp8GemmBound)
            << shape.name << " rows " << rows << (cuda_cores ? " ffma" : " mma");
      }
    }
  }
}

TEST_F(CudaFp8, Bf16InputMatchesTheFp32PathOnBf16Values) {
  // linear_fp8_quantize from a bf16 tensor equals the fp32 path on the same (bf16-valued) numbers, bit for
  // bit.
  const int64_t in = 4096, out = 1024;
  const Fp8Weight w(out, in, 8);
  DeviceArray<uint8_t> dw(w.codes);
  DeviceArray<float> dws(w.scales);
  for (const int64_t rows : {1, 64}) {
    auto x = random_activations(rows, in, 3);
    std::vector<uint16_t> x16(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      x16[i] = f32_to_bf16(x[i]);
      x[i] = bf16_to_f32(x16[i]);
    }
    DeviceArray<float> dx32(x), y32(static_cast<size_t>(rows * out)), y16(static_cast<size_t>(rows * out));
    DeviceArray<uint16_t> dx16(x16);
    Gemm gemm;
    const GemmWeight gw{dw.get(), GemmDtype::kF8E4M3, out, in, 0, dws.get()};
    gemm.linear_fp8_quantize(gw, dx32.get(), GemmDtype::kF32, rows, y32.get(), nullptr);
    gemm.linear_fp8_quantize(gw, dx16.get(), GemmDtype::kBf16, rows, y16.get(), nullptr);
    EXPECT_TRUE(testing::small_ops::bitwise_equal(y32.download(), y16.download())) << "rows " << rows;
  }
}

TEST_F(CudaFp8, BitwiseRepeat) {
  const int64_t in = 4096, out = 1024;
  const Fp8Weight w(out, in, 21);
  DeviceArray<uint8_t> dw(w.codes);
  DeviceArray<float> dws(w.scales);
  for (const int64_t rows : {1, 7, 64, 300}) {
    const auto x = random_activations(rows, in, static_cast<uint32_t>(rows + 1));
    DeviceArray<float> dx(x), a(static_cast<size_t>(rows * out)), b(static_cast<size_t>(rows * out));
    Gemm first, second;  // two plans, as two processes would make them
    const GemmWeight gw{dw.get(), GemmDtype::kF8E4M3, out, in, 0, dws.get()};
    first.linear_fp8_quantize(gw, dx.get(), GemmDtype::kF32, rows, a.get(), nullptr);
    second.linear_fp8_quantize(gw, dx.get(), GemmDtype::kF32, rows, b.get(), nullptr);
    const auto ya = a.download();
    EXPECT_TRUE(testing::small_ops::bitwise_equal(ya, b.download())) << "rows " << rows;
    first.linear_fp8_quantize(gw, dx.get(), GemmDtype::kF32, rows, b.get(), nullptr);
    EXPECT_TRUE(testing::small_ops::bitwise_equal(ya, b.download())) << "rows " << rows << " (same plan)";
  }
}

TEST_F(CudaFp8, RejectsWhatItCannotDo) {
  Gemm gemm;
  DeviceArray<uint8_t> dw(static_cast<size_t>(128 * 128));
  DeviceArray<float> dws(1), y(128);
  EXPECT_THROW(
      gemm.linear({dw.get(), GemmDtype::kF8E4M3, 128, 128, 0, dws.get()}, dw.get(), 1, y.get(), nullptr),
      Error);
  EXPECT_THROW(gemm.linear_fp8({dw.get(), GemmDtype::kF8E4M3, 128, 128, 0, nullptr}, {dw.get(), dws.get(), 0},
                               1, y.get(), nullptr),
               Error);
  Fp8QuantizeParams q;
  q.rows = 2;
  q.cols = 64;
  q.x_stride = 32;  // shorter than a row
  EXPECT_EQ(quantize_e4m3_rows(q, y.get(), dw.get(), dws.get(), nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace dsv4::ops::cuda
