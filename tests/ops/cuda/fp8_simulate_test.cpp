// DeepSeek's FP8 simulation in place (ops/cuda/fp8_quantize.h simulate_e4m3_blocks, Numerics::kDeepSeek) against
// its CPU twin ops::cpu::quantize_e4m3_blocks, bit for bit: the K=V vectors' non-rope channels per 64, the experts'
// input per 128, odd widths, the quantizer's edge rows, fp32 and bf16 storage. Random inputs; outputs compared
// whole. Also runs on the host without a GPU (tests/ops/cuda/emu/run_fp8_simulate_emu.sh). Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "fp8_test_inputs.h"
#include "ops/cpu/quantize.h"
#include "ops/cuda/fp8_quantize.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::DeviceArray;
using testing::random_activations;
using testing::same_bits;

class CudaFp8Simulation : public testing::small_ops::GpuTest {};

// The in-place FP8 simulation (kDeepSeek) against ops::cpu::quantize_e4m3_blocks on each row's leading `cols`
// of `stride` columns, bit for bit; the columns past `cols` untouched.
void check_simulation(const std::vector<float>& x, int64_t rows, int64_t stride, int64_t cols, int64_t block,
                      bool bf16) {
  SCOPED_TRACE(::testing::Message() << "rows " << rows << " cols " << cols << "/" << stride << " block " << block
                                    << (bf16 ? " bf16" : " fp32"));
  std::vector<float> host(x.begin(), x.begin() + rows * stride);
  if (bf16)
    for (float& v : host) v = bf16_to_f32(f32_to_bf16(v));
  std::vector<float> expected = host;
  for (int64_t r = 0; r < rows; ++r) cpu::quantize_e4m3_blocks(&expected[r * stride], cols, block);
  Fp8SimulateParams p;
  p.rows = rows;
  p.cols = cols;
  p.stride = stride;
  p.block = block;
  p.bf16 = bf16;
  std::vector<float> got(host.size());
  if (bf16) {
    std::vector<uint16_t> bits(host.size());
    for (size_t i = 0; i < host.size(); ++i) bits[i] = f32_to_bf16(host[i]);
    DeviceArray<uint16_t> d(bits);
    ASSERT_EQ(simulate_e4m3_blocks(p, d.get(), nullptr), cudaSuccess);
    const std::vector<uint16_t> out = d.download();
    for (size_t i = 0; i < out.size(); ++i) got[i] = bf16_to_f32(out[i]);
  } else {
    DeviceArray<float> d(host);
    ASSERT_EQ(simulate_e4m3_blocks(p, d.get(), nullptr), cudaSuccess);
    got = d.download();
  }
  int64_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!same_bits(got[i], expected[i]) && mismatches++ < 5)
      ADD_FAILURE() << "element " << i << ": " << got[i] << " vs " << expected[i] << " from " << host[i];
  EXPECT_EQ(mismatches, 0);
}

TEST_F(CudaFp8Simulation, IsBitExactWithTheCpuTwin) {
  for (const bool bf16 : {false, true}) {
    // The K=V vectors' 448 non-rope channels of 512 per 64; the experts' input per 128; odd widths.
    check_simulation(random_activations(37, 512, 5), 37, 512, 448, 64, bf16);
    check_simulation(random_activations(9, 4096, 6), 9, 4096, 4096, 128, bf16);
    check_simulation(random_activations(5, 200, 7), 5, 200, 197, 64, bf16);
    check_simulation(random_activations(3, 96, 8), 3, 96, 96, 32, bf16);
  }
  Fp8SimulateParams bad;
  bad.rows = 1;
  bad.cols = 64;
  bad.block = 48;
  EXPECT_EQ(simulate_e4m3_blocks(bad, nullptr, nullptr), cudaErrorInvalidValue);
}

TEST_F(CudaFp8Simulation, EdgeValues) {
  for (const bool bf16 : {false, true})
    for (const int64_t block : {64, 128}) check_simulation(testing::fp8_edge_values(256, block), 6, 256, 256, block, bf16);
}

}  // namespace
}  // namespace dsv4::ops::cuda
