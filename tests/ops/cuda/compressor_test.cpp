// The fused compressor step (ops/cuda/compressor.h) against the sequential CPU compressor + RMSNorm + RoPE
// (tests/ops/cuda/compressor_problem.h), at V4-Flash shapes: CSA main (ratio 4, overlap, d 512), CSA index keys
// (d 128) and HCA (ratio 128, d 512), a batch with starts 0/3/127/128/1000 and chunks 1..1030 over six
// consecutive steps. After every step the state bytes must equal the CPU's exactly and the history entries
// match (fp32 within 1e-5, bf16 within one ulp, FP8 byte for byte but for rare bf16-tie flips); untouched bytes
// must be untouched. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cache/kv_entry_format.h"
#include "compressor_problem.h"
#include "core/dtype.h"
#include "ops/cuda/device.h"

namespace dsv4::ops::cuda {
namespace {

using testing::CompressorCase;
using testing::CompressorEntry;
using testing::CompressorProblem;
using testing::CompressorSnapshot;

using testing::CudaCompressor;

void write_f32(const PagedGroupView& h, const CompressorEntry& e) {
  if (std::byte* at = paged_entry(h, e.row, e.w)) std::memcpy(at, e.values.data(), e.values.size() * sizeof(float));
}

void write_bf16(const PagedGroupView& h, const CompressorEntry& e) {
  std::byte* at = paged_entry(h, e.row, e.w);
  if (!at) return;
  for (size_t c = 0; c < e.values.size(); ++c) {
    const uint16_t bits = f32_to_bf16(e.values[c]);
    std::memcpy(at + 2 * c, &bits, 2);
  }
}

void write_fp8_main(const PagedGroupView& h, const CompressorEntry& e) {
  PagedKvPool pool;
  pool.arena = reinterpret_cast<uint8_t*>(h.arena);
  pool.page_bytes = h.page_bytes;
  pool.blocks_per_page = h.max_blocks_per_page;
  pool.block_bytes = h.block_bytes;
  pool.region_offset = h.layer_index * kv_region_bytes(KvEntryFormat::kFp8, h.entries_per_block);
  pool.entries_per_block = static_cast<int32_t>(h.entries_per_block);
  pool.block_table = h.block_table;
  pool.block_table_stride = h.block_table_stride;
  const KvEntryAddress address = kv_entry_address(pool, KvEntryFormat::kFp8, e.row, e.w);
  if (!address.data) return;
  std::vector<uint16_t> bf16(e.values.size());
  for (size_t c = 0; c < bf16.size(); ++c) bf16[c] = f32_to_bf16(e.values[c]);
  kv_quantize_entry(KvEntryFormat::kFp8, bf16.data(), address, false);
}

testing::CompressorProblem::Writer writer_for(CompressorEntryFormat format) {
  switch (format) {
    case CompressorEntryFormat::kF32: return write_f32;
    case CompressorEntryFormat::kBf16: return write_bf16;
    case CompressorEntryFormat::kFp8Main: return write_fp8_main;
    case CompressorEntryFormat::kFp8Index: break;  // compressor_index_fp8_test.cpp
    case CompressorEntryFormat::kBf16DeepSeekMain:
    case CompressorEntryFormat::kBf16DeepSeekIndex: return write_bf16;  // the CPU twin finished the values
  }
  return nullptr;
}

// fp32 words: equal bits, or both finite within 1e-5 relative (+1e-6 absolute for values near zero).
void expect_f32_close(const std::vector<std::byte>& gpu, const std::vector<std::byte>& cpu, size_t step) {
  ASSERT_EQ(gpu.size(), cpu.size());
  size_t differing = 0, bad = 0;
  double worst = 0;
  for (size_t i = 0; i + 4 <= gpu.size(); i += 4) {
    if (std::memcmp(&gpu[i], &cpu[i], 4) == 0) continue;
    ++differing;
    float a, b;
    std::memcpy(&a, &gpu[i], 4);
    std::memcpy(&b, &cpu[i], 4);
    const double err = std::fabs(static_cast<double>(a) - b);
    if (!std::isfinite(a) || !std::isfinite(b) || err > 1e-5 * std::fabs(b) + 1e-6) {
      if (bad < 5) ADD_FAILURE() << "step " << step << " word " << i / 4 << ": gpu " << a << " cpu " << b;
      ++bad;
    }
    worst = std::max(worst, err / (std::fabs(b) + 1e-6));
  }
  EXPECT_EQ(bad, 0u) << "step " << step;
  std::printf("  step %zu: %zu fp32 words differ in the last bits (worst rel %.2e)\n", step, differing, worst);
}

// bf16 halves: equal, or one ulp apart (a value within 1e-6 of zero may change sign).
void expect_bf16_close(const std::vector<std::byte>& gpu, const std::vector<std::byte>& cpu, size_t step) {
  ASSERT_EQ(gpu.size(), cpu.size());
  size_t one_ulp = 0, bad = 0;
  for (size_t i = 0; i + 2 <= gpu.size(); i += 2) {
    uint16_t a, b;
    std::memcpy(&a, &gpu[i], 2);
    std::memcpy(&b, &cpu[i], 2);
    if (a == b) continue;
    const bool same_sign_neighbours =
        (a & 0x8000) == (b & 0x8000) && std::abs(static_cast<int>(a) - static_cast<int>(b)) == 1;
    if (same_sign_neighbours || std::fabs(bf16_to_f32(a) - bf16_to_f32(b)) <= 1e-6f) {  // or both ~0
      ++one_ulp;
      continue;
    }
    if (bad < 5) ADD_FAILURE() << "step " << step << " half " << i / 2 << ": gpu " << std::hex << a << " cpu " << b;
    ++bad;
  }
  EXPECT_EQ(bad, 0u) << "step " << step;
  std::printf("  step %zu: %zu bf16 values one ulp off\n", step, one_ulp);
}

// kDeepSeek's bf16 entries: the e4m3 / FP4 simulation turns a one-ulp difference of the pooled value (CUDA's expf
// against glibc's) into a whole quantization step, and an FP4 block scale change into a block of 32; so the count
// of differing values is bounded (1 %, at least one block), not their size. The host emulation (glibc's expf on
// both sides) gives none.
void expect_deepseek_bf16_close(const std::vector<std::byte>& gpu, const std::vector<std::byte>& cpu, size_t step,
                                size_t written_values) {
  ASSERT_EQ(gpu.size(), cpu.size());
  size_t differing = 0;
  for (size_t i = 0; i + 2 <= gpu.size(); i += 2) differing += std::memcmp(&gpu[i], &cpu[i], 2) != 0;
  EXPECT_LE(differing, std::max<size_t>(32, written_values / 100)) << "step " << step;
  std::printf("  step %zu: %zu of %zu written bf16 values differ\n", step, differing, written_values);
}

// FP8: bytes equal but for rare flips where the bf16 image sits one ulp apart (≤ 1 in 1000 written bytes).
void expect_fp8_close(const std::vector<std::byte>& gpu, const std::vector<std::byte>& cpu, size_t step,
                      size_t written_bytes) {
  ASSERT_EQ(gpu.size(), cpu.size());
  size_t differing = 0;
  for (size_t i = 0; i < gpu.size(); ++i) differing += gpu[i] != cpu[i];
  EXPECT_LE(differing, std::max<size_t>(4, written_bytes / 1000)) << "step " << step;
  std::printf("  step %zu: %zu of %zu written bytes differ\n", step, differing, written_bytes);
}

void expect_state_equal(const std::vector<std::byte>& gpu, const std::vector<std::byte>& cpu, size_t step) {
  ASSERT_EQ(gpu.size(), cpu.size());
  size_t differing = 0, first = gpu.size();
  for (size_t i = 0; i < gpu.size(); ++i)
    if (gpu[i] != cpu[i]) {
      if (first == gpu.size()) first = i;
      ++differing;
    }
  EXPECT_EQ(differing, 0u) << "step " << step << ": state bytes differ, first at byte " << first;
}

// Runs the case on both sides, comparing after every step.
void check_case(const CompressorCase& c) {
  CompressorProblem problem(c);
  CompressorProblem::GpuRun gpu(problem, -1);
  CompressorProblem::CpuRun cpu(problem, writer_for(c.format));
  size_t written = 0, total_entries = 0;
  for (size_t s = 0; s < problem.num_steps(); ++s) {
    const cudaError_t status = gpu.step(s);
    ASSERT_EQ(status, cudaSuccess) << "step " << s << ": " << cudaGetErrorString(status);
    const auto entries = cpu.step(s);
    const CompressorSnapshot actual = gpu.snapshot();
    const CompressorSnapshot& expected = cpu.snapshot();
    expect_state_equal(actual.state, expected.state, s);
    written += entries.size() * static_cast<size_t>(testing::compressor_entry_bytes(c.format, c.head_dim));
    total_entries += entries.size();
    switch (c.format) {
      case CompressorEntryFormat::kF32: expect_f32_close(actual.history, expected.history, s); break;
      case CompressorEntryFormat::kBf16: expect_bf16_close(actual.history, expected.history, s); break;
      case CompressorEntryFormat::kBf16DeepSeekMain:
      case CompressorEntryFormat::kBf16DeepSeekIndex:
        expect_deepseek_bf16_close(actual.history, expected.history, s, written / 2);
        break;
      default: expect_fp8_close(actual.history, expected.history, s, written); break;
    }
  }
  EXPECT_GT(total_entries, 0u);
}

// Every step's device bytes of one run.
std::vector<CompressorSnapshot> gpu_snapshots(const CompressorProblem& problem, int max_blocks) {
  CompressorProblem::GpuRun gpu(problem, max_blocks);
  std::vector<CompressorSnapshot> out;
  for (size_t s = 0; s < problem.num_steps(); ++s) {
    EXPECT_EQ(gpu.step(s), cudaSuccess);
    out.push_back(gpu.snapshot());
  }
  return out;
}

CompressorCase csa_main(CompressorEntryFormat format) {
  CompressorCase c;
  c.ratio = 4;
  c.head_dim = 512;
  c.rope_dim = 64;
  c.overlap = true;
  c.format = format;
  c.starts = testing::flash_starts();
  c.steps = testing::flash_steps();
  c.seed = 11;
  return c;
}

CompressorCase csa_index(CompressorEntryFormat format) {
  CompressorCase c = csa_main(format);
  c.head_dim = 128;
  c.seed = 12;
  return c;
}

CompressorCase hca(CompressorEntryFormat format) {
  CompressorCase c = csa_main(format);
  c.ratio = 128;
  c.overlap = false;
  c.seed = 13;
  return c;
}

TEST_F(CudaCompressor, CsaMainF32) { check_case(csa_main(CompressorEntryFormat::kF32)); }
TEST_F(CudaCompressor, CsaIndexF32) { check_case(csa_index(CompressorEntryFormat::kF32)); }
TEST_F(CudaCompressor, HcaF32) { check_case(hca(CompressorEntryFormat::kF32)); }
TEST_F(CudaCompressor, CsaMainBf16) { check_case(csa_main(CompressorEntryFormat::kBf16)); }
TEST_F(CudaCompressor, CsaIndexBf16) { check_case(csa_index(CompressorEntryFormat::kBf16)); }
TEST_F(CudaCompressor, HcaBf16) { check_case(hca(CompressorEntryFormat::kBf16)); }
TEST_F(CudaCompressor, CsaMainFp8) { check_case(csa_main(CompressorEntryFormat::kFp8Main)); }
// Numerics::kDeepSeek: the reference's roundings, the main entries' FP8 simulation, the index keys' Hadamard + FP4.
TEST_F(CudaCompressor, CsaMainDeepSeek) { check_case(csa_main(CompressorEntryFormat::kBf16DeepSeekMain)); }
TEST_F(CudaCompressor, CsaIndexDeepSeek) { check_case(csa_index(CompressorEntryFormat::kBf16DeepSeekIndex)); }
TEST_F(CudaCompressor, HcaDeepSeek) { check_case(hca(CompressorEntryFormat::kBf16DeepSeekMain)); }
TEST_F(CudaCompressor, HcaFp8) { check_case(hca(CompressorEntryFormat::kFp8Main)); }

// 128 requests at scattered positions, six decode steps then a mixed step: the decode launch shape.
TEST_F(CudaCompressor, DecodeBatch128) {
  std::mt19937 rng(5);
  for (const bool is_hca : {false, true}) {
    CompressorCase c = is_hca ? hca(CompressorEntryFormat::kBf16) : csa_main(CompressorEntryFormat::kBf16);
    c.state_layers = 1;  // HCA: 512 KB of state per request
    c.state_layer_index = 0;
    c.starts.clear();
    for (int r = 0; r < 128; ++r) c.starts.push_back(static_cast<int32_t>(rng() % 5000));
    c.steps.assign(6, std::vector<int32_t>(128, 1));
    std::vector<int32_t> mixed(128, 1);
    mixed[7] = 257;
    mixed[100] = 0;
    c.steps.push_back(mixed);
    check_case(c);
  }
}

// The grid-stride loop: one CTA, or three, doing every task must give the same bytes as the full grid.
TEST_F(CudaCompressor, AnyGridGivesTheSameBytes) {
  for (const bool is_hca : {false, true}) {
    const CompressorCase c = is_hca ? hca(CompressorEntryFormat::kF32) : csa_index(CompressorEntryFormat::kF32);
    CompressorProblem problem(c);
    const auto full = gpu_snapshots(problem, -1);
    for (const int blocks : {1, 3}) {
      const auto small = gpu_snapshots(problem, blocks);
      ASSERT_EQ(small.size(), full.size());
      for (size_t s = 0; s < full.size(); ++s) {
        EXPECT_TRUE(small[s].history == full[s].history) << "blocks " << blocks << " step " << s;
        EXPECT_TRUE(small[s].state == full[s].state) << "blocks " << blocks << " step " << s;
      }
    }
  }
}

TEST_F(CudaCompressor, RepeatIsBitwise) {
  for (const CompressorCase& c : {csa_main(CompressorEntryFormat::kF32), hca(CompressorEntryFormat::kBf16)}) {
    CompressorProblem problem(c);
    const auto first = gpu_snapshots(problem, -1), second = gpu_snapshots(problem, -1);
    ASSERT_EQ(first.size(), second.size());
    for (size_t s = 0; s < first.size(); ++s) {
      EXPECT_TRUE(first[s].history == second[s].history) << "step " << s;
      EXPECT_TRUE(first[s].state == second[s].state) << "step " << s;
    }
  }
}

// The tiny preset's shapes (head_dim 128 / index 64, rope 32) and an odd ratio, in fp32.
TEST_F(CudaCompressor, OtherShapes) {
  CompressorCase tiny_main = csa_main(CompressorEntryFormat::kF32);
  tiny_main.head_dim = 128;
  tiny_main.rope_dim = 32;
  check_case(tiny_main);
  CompressorCase tiny_index = tiny_main;
  tiny_index.head_dim = 64;
  check_case(tiny_index);
  CompressorCase tiny_hca = hca(CompressorEntryFormat::kF32);
  tiny_hca.head_dim = 128;
  tiny_hca.rope_dim = 32;
  tiny_hca.ratio = 16;
  check_case(tiny_hca);
  CompressorCase wide_overlap = csa_index(CompressorEntryFormat::kF32);
  wide_overlap.ratio = 8;  // 16 slots: the streaming pooling path with overlap
  check_case(wide_overlap);
}

TEST_F(CudaCompressor, RejectsBadParameters) {
  CompressorStepParams p;
  p.history.entry_bytes = 4 * 512;
  p.history.entries_per_block = 64;
  p.state.entry_bytes = 2 * 8 * 1024 * 4;
  p.state.entries_per_block = 1;
  EXPECT_EQ(compressor_step(p, nullptr), cudaSuccess);  // empty batch
  CompressorStepParams bad = p;
  bad.head_dim = 513;
  EXPECT_EQ(compressor_step(bad, nullptr), cudaErrorInvalidValue);
  bad = p;
  bad.state.entry_bytes -= 4;
  EXPECT_EQ(compressor_step(bad, nullptr), cudaErrorInvalidValue);
  bad = p;
  bad.format = CompressorEntryFormat::kBf16;
  EXPECT_EQ(compressor_step(bad, nullptr), cudaErrorInvalidValue);
  bad = p;
  bad.format = CompressorEntryFormat::kFp8Main;
  bad.history.entry_bytes = 584;
  bad.rope_dim = 32;
  EXPECT_EQ(compressor_step(bad, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace dsv4::ops::cuda
