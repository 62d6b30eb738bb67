// ops/cuda/hadamard_fp4 (DeepSeek's FP4 simulation of the indexer's queries and keys) against its CPU twin
// ops::cpu::hadamard_fp4 (round_to_bf16, hadamard_transform(dim^-0.5), round_to_bf16, quantize_e2m1_blocks(block),
// round_to_bf16), which kDeepSeek runs on the CPU — bit for bit. Random rows whose magnitudes span 2^-20 … 2^20, a row
// with one block of zeros (its scale floor), dims 64 / 128 / 256, blocks 32 and 16; rejected shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "ops/cpu/quantize.h"
#include "ops/cuda/hadamard_fp4.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::DeviceArray;

class CudaHadamardFp4 : public testing::small_ops::GpuTest {};

std::vector<float> random_rows(int64_t rows, int64_t dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::vector<float> x(static_cast<size_t>(rows * dim));
  for (int64_t r = 0; r < rows; ++r) {
    const float magnitude = std::ldexp(1.0f, exponent(rng));
    for (int64_t i = 0; i < dim; ++i) x[static_cast<size_t>(r * dim + i)] = magnitude * normal(rng);
  }
  return x;
}

std::vector<float> cpu_twin(std::vector<float> x, const HadamardFp4Params& p) {
  for (int64_t r = 0; r < p.rows; ++r) cpu::hadamard_fp4(x.data() + r * p.dim, p.dim, p.scale, p.block);
  return x;
}

TEST_F(CudaHadamardFp4, MatchesTheCpuRecipeBitForBit) {
  for (const int64_t dim : {int64_t{64}, int64_t{128}, int64_t{256}})
    for (const int64_t block : {int64_t{32}, int64_t{16}}) {
      SCOPED_TRACE(::testing::Message() << "dim " << dim << " block " << block);
      HadamardFp4Params p;
      p.rows = 301;
      p.dim = dim;
      p.block = block;
      p.scale = static_cast<float>(std::pow(static_cast<double>(dim), -0.5));
      std::vector<float> x = random_rows(p.rows, dim, static_cast<uint32_t>(dim + block));
      // Row 7: before the transform one half is ±1 and the other zero, so the transformed row has blocks of
      // equal magnitudes; row 8 is zero in its first input block only.
      for (int64_t i = 0; i < dim; ++i) x[static_cast<size_t>(7 * dim + i)] = i < dim / 2 ? (i % 3 ? 1.0f : -1.0f) : 0.0f;
      for (int64_t i = 0; i < block; ++i) x[static_cast<size_t>(8 * dim + i)] = 0.0f;
      const std::vector<float> expected = cpu_twin(x, p);
      DeviceArray<float> dx(x);
      ASSERT_EQ(hadamard_fp4_rows(p, dx.get(), nullptr), cudaSuccess);
      const std::vector<float> actual = dx.download();
      for (size_t i = 0; i < actual.size(); ++i)
        ASSERT_EQ(0, std::memcmp(&actual[i], &expected[i], sizeof(float)))
            << "row " << i / dim << " column " << i % dim << ": " << actual[i] << " against " << expected[i];
    }
}

TEST_F(CudaHadamardFp4, RejectsWhatItDoesNotTake) {
  DeviceArray<float> x(1024);
  HadamardFp4Params p;
  p.rows = 2;
  p.scale = 0.125f;
  p.dim = 96;  // not a power of two
  EXPECT_EQ(hadamard_fp4_rows(p, x.get(), nullptr), cudaErrorInvalidValue);
  p.dim = 128;
  p.block = 2;  // smaller than a lane's 4 values
  EXPECT_EQ(hadamard_fp4_rows(p, x.get(), nullptr), cudaErrorInvalidValue);
  p.block = 24;  // 6 lanes: not a power of two
  EXPECT_EQ(hadamard_fp4_rows(p, x.get(), nullptr), cudaErrorInvalidValue);
  p.block = 32;
  p.scale = 0.0f;
  EXPECT_EQ(hadamard_fp4_rows(p, x.get(), nullptr), cudaErrorInvalidValue);
  p.scale = 0.125f;
  EXPECT_EQ(hadamard_fp4_rows(p, x.get(), nullptr), cudaSuccess);
}

}  // namespace
}  // namespace dsv4::ops::cuda
